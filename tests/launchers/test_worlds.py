"""The world check under real launchers: MPICH's mpirun, spmd run, torchrun, plain python.

Each world runs tests/worlds/check_comm.py, which checks every collective
with values computed from the size, and prints one line per rank.
"""

import os
import re

import pytest

from tests.support import MPIRUN, PY, WORLDS, assert_world, clean_env, finish, missing, run, start, tool

CHECK = WORLDS / "check_comm.py"

pytestmark = [pytest.mark.launcher, pytest.mark.skipif(MPIRUN is None, reason="mpirun not found: pip install mpich")]


@pytest.mark.timeout(60)
def test_plain_python_is_a_world_of_one():
    assert_world(run([PY, CHECK], 50), 1, backend="serial", launcher="none")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size, backend", [(2, "mpi"), (4, "mpi"), (8, "mpi"), (4, "gloo")])
def test_mpich_mpirun(size, backend):
    # gloo's collectives at other sizes: tests/comms/test_world_check.py, on the plugin's ranks
    env = clean_env(SPMD_BACKEND=backend)
    result = run([MPIRUN, "-n", size, PY, "-m", "spmd", CHECK], 110, env)
    assert_world(result, size, backend=backend, launcher="mpich")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_the_world_check_passes_in_debug_mode(backend):
    # Debug mode's cross-rank checks and point-to-point verdicts must not
    # change any result, nor deadlock the rings of sends the check makes.
    env = clean_env(SPMD_BACKEND=backend, SPMD_DEBUG="1")
    result = run([MPIRUN, "-n", 3, PY, "-m", "spmd", CHECK], 140, env)
    assert_world(result, 3, backend=backend, launcher="mpich")


@pytest.mark.timeout(120)
def test_mpirun_auto_picks_mpi_and_numpy_only_scripts_skip_torch():
    # Without torch tensors the script never imports torch; auto chooses mpi.
    if os.path.exists("/dev/nvidiactl"):
        missing("a GPU machine: auto asks CUDA whether nccl is usable (spmd.runtime.backends.cuda_usable), "
                "which imports torch even when CUDA_VISIBLE_DEVICES hides every GPU")
    code = (
        "import runpy, sys; sys.argv = ['check', '--numpy-only'];"
        f"runpy.run_path({str(CHECK)!r}, run_name='__main__');"
        "print('TORCH', 'torch' in sys.modules)"
    )
    result = run([MPIRUN, "-n", 4, PY, "-c", code], 110)
    assert_world(result, 4, backend="mpi", launcher="mpich")
    assert re.findall(r"TORCH\s*(True|False)", result.stdout) == ["False"] * 4, result.stdout


@pytest.mark.timeout(120)
def test_spmd_run():
    result = run([tool("spmd"), "run", "-n", 4, CHECK], 110)
    assert_world(result, 4, backend="gloo", launcher="spmd")
    assert "[3] CHECKS OK" in result.stdout


@pytest.mark.timeout(120)
def test_torchrun():
    torchrun = tool("torchrun")
    result = run([torchrun, "--nproc-per-node", 2, "-m", "spmd", CHECK], 110)
    assert_world(result, 2, backend="gloo", launcher="torchrun")


@pytest.mark.timeout(180)
def test_two_jobs_at_once_on_one_machine():
    """Rendezvous ports are bound by the publisher, so simultaneous jobs never collide."""
    jobs = [
        start([MPIRUN, "-n", 2, PY, "-m", "spmd", CHECK], clean_env(SPMD_BACKEND="gloo")),
        start([MPIRUN, "-n", 2, PY, "-m", "spmd", CHECK], clean_env(SPMD_BACKEND="gloo")),
        start([tool("spmd"), "run", "-n", 2, CHECK]),
        start([tool("spmd"), "run", "-n", 2, CHECK]),
    ]
    for job in jobs:
        assert_world(finish(job, 170, "one of four simultaneous jobs"), 2, backend="gloo")
