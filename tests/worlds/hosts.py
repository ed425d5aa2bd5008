"""Where each rank runs and how it reaches the others: hosts.py, under any launcher, on the private cluster.

Each rank checks an all_reduce, an all_gather and a split by host (comm.split(color=node_rank)
must hold exactly the ranks of this host), then rank 0 prints one line
``HOSTS <json>``: per rank its host name, placement numbers, chosen address and interface (and
why), GLOO_SOCKET_IFNAME as gloo saw it, and the interface Open MPI's TCP transport was told
(OMPI_MCA_btl_tcp_if_include).
"""

import json
import os
import socket

import numpy as np

from spmd import comm

host = socket.gethostname()
x = np.full(3, comm.rank + 1.0)
comm.all_reduce(x)
assert (x == comm.size * (comm.size + 1) / 2).all(), f"rank {comm.rank}: all_reduce gave {x}"
names = comm.all_gather_object(host)
same_host = [r for r, name in enumerate(names) if name == host]
sub = comm.split(color=comm.node_rank)
members = sub.all_gather_object(comm.rank)
assert members == same_host, f"rank {comm.rank} on {host}: split by node_rank holds {members}, this host {same_host}"
p = comm.placement
row = {"rank": comm.rank, "host": host, "node_rank": comm.node_rank, "num_nodes": comm.num_nodes,
       "local_rank": comm.local_rank, "local_size": comm.local_size, "address": p.address,
       "interface": p.interface, "why": p.sources.get("address"), "gloo": os.environ.get("GLOO_SOCKET_IFNAME"),
       "ompi_btl": os.environ.get("OMPI_MCA_btl_tcp_if_include"),
       "backend": comm.backend, "launcher": comm.launcher}
rows = comm.gather_object(row, root=0)
if comm.rank == 0:
    print("HOSTS " + json.dumps(rows), flush=True)
