"""hosts.py with init's clock: timed_init.py imports what init would (torch.distributed, unless an MPI launcher
started it without SPMD_BACKEND=gloo: the mpi backend then runs alone), prints tests.support.PROMISE's line,
then runs tests/worlds/hosts.py, whose first use of comm starts spmd.  A test bounds how long an error at
init takes with since_promise (docs/testing.md)."""

import os
import runpy
import time
from pathlib import Path

MPI = any(v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK"))
if os.environ.get("SPMD_BACKEND") == "gloo" or not MPI:  # under MPI it would start torch's group beside MPI
    import torch.distributed  # noqa: F401
import spmd.runtime.start  # noqa: F401

print(f"SPMD-PROMISE-AT {time.monotonic():.6f}", flush=True)
runpy.run_path(str(Path(__file__).with_name("hosts.py")), run_name="__main__")
