"""A split whose connection fails on one rank: flaky_split.py once|always.

Rank 1's gloo cannot make its device for the first group it makes (once)
or for every one (always): GLOO_SOCKET_IFNAME names no interface while it
does, a real gloo error, raised after torch has counted the group.  With
once, every rank must end with a working split of two pairs; with always,
every rank must raise CommunicationError naming rank 1's error.
"""

import os
import sys

import numpy as np
import torch.distributed as dist

import spmd
from spmd.errors import CommunicationError

mode = sys.argv[1]
comm = spmd.init()
real, made = dist.new_group, []


def flaky(*args, **kwargs):
    made.append(1)
    if len(made) > 1 and mode == "once":
        return real(*args, **kwargs)
    kept = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = "spmd-no-such-if"
    try:
        return real(*args, **kwargs)
    finally:
        if kept is None:
            del os.environ["GLOO_SOCKET_IFNAME"]
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = kept


if comm.rank == 1:
    dist.new_group = flaky
try:
    pair = comm.split(comm.rank // 2, comm.rank)
except CommunicationError as exc:
    print(f"RAISED {comm.rank} {exc}", flush=True)
    sys.exit(0)
total = pair.all_reduce(np.array([float(comm.rank)]))[0]
print(f"PAIR {comm.rank} size {pair.size} rank {pair.rank} sum {total:g}", flush=True)
pair.free()
