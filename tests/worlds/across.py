"""Everything a launcher must get right across hosts, in one world (tests/cluster/test_launchers.py).

One launch runs, in order, as a user would run them:

- the guide's collectives (jobs/collectives.py), between ``== GUIDE ==`` and ``== END GUIDE ==``;
- the main job (jobs/scatter_gather.py, 60,000 rows in rounds of 8,192): its ``checksum`` line;
- DataParallel training (jobs/train_dp.py, 4 steps, global batch 12): its ``parameters identical``
  line, the sha256 of the parameters;
- where each rank runs: an all_reduce, an all_gather and a split by host (the split by node_rank
  must hold exactly the ranks of this host), then rank 0 prints ``HOSTS <json>`` as
  tests/worlds/hosts.py does.

A test compares the first three with the same world on one host, and reads the rows.  Every rank
computes on one thread (OMP_NUM_THREADS=1, set before torch loads): the training's arithmetic then
does not depend on how many ranks share a host, as train_dp's own thread share would make it.
"""

import importlib.util
import json
import os
import socket
import sys
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"  # before torch loads (see the docstring)

from spmd import comm  # noqa: E402

JOBS = Path(__file__).resolve().parents[2] / "jobs"


def job(name):
    """jobs/<name>.py as a module (its __main__ block not run)."""
    spec = importlib.util.spec_from_file_location(f"jobs_{name}", JOBS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def say(text):
    if comm.rank == 0:
        print(text, flush=True)


say("== GUIDE ==")
job("collectives").main()
say("== END GUIDE ==")
job("scatter_gather").main.main(["--rows", "60000", "--chunk-rows", "8192"], standalone_mode=False)
job("train_dp").main.main(["--steps", "4", "--global-batch", "12", "--vocab", "512", "--log-every", "0"],
                          standalone_mode=False)

host = socket.gethostname()
names = comm.all_gather_object(host)
same_host = [r for r, name in enumerate(names) if name == host]
sub = comm.split(color=comm.node_rank)
members = sub.all_gather_object(comm.rank)
assert members == same_host, f"rank {comm.rank} on {host}: split by node_rank holds {members}, this host {same_host}"
p = comm.placement
row = {"rank": comm.rank, "host": host, "node_rank": comm.node_rank, "num_nodes": comm.num_nodes,
       "local_rank": comm.local_rank, "local_size": comm.local_size, "address": p.address,
       "interface": p.interface, "why": p.sources.get("address"), "gloo": os.environ.get("GLOO_SOCKET_IFNAME"),
       "backend": comm.backend, "launcher": comm.launcher}
rows = comm.gather_object(row, root=0)
say("HOSTS " + json.dumps(rows))
sys.stdout.flush()
