"""Everything a launcher must get right across hosts, in one world (tests/cluster/test_launchers.py).

One launch runs, in order, as a user would run them:

- the guide's collectives (jobs/collectives.py), between ``== GUIDE ==`` and ``== END GUIDE ==``;
- the main job (jobs/scatter_gather.py, 60,000 rows in rounds of 8,192): its ``checksum`` line;
- DataParallel training (jobs/train_dp.py, 4 steps, global batch 12): its ``parameters identical``
  line, the sha256 of the parameters;
- where each rank runs: tests/worlds/hosts.py (an all_reduce, an all_gather, a split by host, and
  rank 0's ``HOSTS <json>`` line).

A test compares the first three with the same world on one host, and reads the rows.  Every rank
computes on one thread (OMP_NUM_THREADS=1, set before torch loads): the training's arithmetic then
does not depend on how many ranks share a host, as train_dp's own thread share would make it.
"""

import importlib.util
import os
import runpy
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

runpy.run_path(str(Path(__file__).with_name("hosts.py")), run_name="__main__")  # where each rank runs
