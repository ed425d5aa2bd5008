"""Bad set-ups and failing ranks: a clear error on every rank, promptly, never a hang."""

import socket

import pytest

from tests.support import MPIRUN, PROMISE, PY, clean_env, run, since_promise, tool

pytestmark = [pytest.mark.launcher, pytest.mark.skipif(MPIRUN is None, reason="mpirun not found: pip install mpich")]

SPMD = tool("spmd")


def script(tmp_path, body):
    path = tmp_path / "job.py"
    path.write_text("from spmd import comm\n" + body)
    return path


def count_errors(out, words):
    return sum(all(w in line for w in words) for line in out.splitlines())


@pytest.mark.timeout(60)
def test_a_rank_that_raises_ends_the_mpi_job_with_its_traceback(tmp_path):
    job = script(tmp_path, f"if comm.rank == 1:\n    {PROMISE}\n    raise ValueError('bad record 42')\ncomm.barrier()\n")
    result = run([MPIRUN, "-n", 3, PY, "-m", "spmd", job], 50)
    assert result.returncode != 0
    assert since_promise(result.stdout) < 30, result.stdout  # from the raise, not the launcher's start
    assert "### spmd: rank 1 of 3" in result.stdout
    assert "ValueError: bad record 42" in result.stdout


@pytest.mark.timeout(60)
def test_a_rank_that_exits_nonzero_ends_spmd_run(tmp_path):
    job = script(tmp_path, "import sys\nif comm.rank == 0:\n    sys.exit(7)\ncomm.barrier()\n")
    result = run([SPMD, "run", "-n", 2, job], 50)
    assert result.returncode == 7
    assert "rank 0 exited with code 7" in result.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("setting, words", [
    ({"SPMD_BACKEND": "infiniband"}, ["unknown backend 'infiniband'", "gloo, nccl, mpi"]),
    ({"SPMD_KEEP_RESULTS": "lots"}, ["SPMD_KEEP_RESULTS='lots' is not a size", "512M"]),
], ids=["unknown backend", "bad result pool limit"])
def test_a_bad_setting_is_an_error_on_every_rank(tmp_path, setting, words):
    job = script(tmp_path, "comm.barrier()\n")
    result = run([MPIRUN, "-n", 2, PY, job], 50, clean_env(**setting))
    assert result.returncode != 0
    assert count_errors(result.stdout, words) == 2


@pytest.mark.timeout(60)
def test_unavailable_backend_lists_the_available_ones(tmp_path):
    job = script(tmp_path, "comm.barrier()\n")
    result = run([SPMD, "run", "-n", 2, "--backend", "nccl", job], 50)
    assert result.returncode != 0
    assert count_errors(result.stdout, ["backend 'nccl' is not available", "Available: gloo, mpi"]) >= 1


@pytest.mark.timeout(60)
def test_mpi_backend_without_an_mpi_launcher(tmp_path):
    job = script(tmp_path, "comm.barrier()\n")
    result = run([SPMD, "run", "-n", 2, "--backend", "mpi", job], 50)
    assert result.returncode != 0
    assert "needs an MPI launcher" in result.stdout


@pytest.mark.timeout(60)
def test_unresolvable_master_addr_fails_at_once(tmp_path):
    job = script(tmp_path, f"{PROMISE}\ncomm.barrier()\n")  # init starts at the first use of comm
    env = clean_env(SPMD_BACKEND="gloo", MASTER_ADDR="no-such-host.invalid", MASTER_PORT="29411")
    result = run([MPIRUN, "-n", 2, PY, job], 50, env)
    assert result.returncode != 0 and since_promise(result.stdout) < 30, result.stdout
    # rank 0 finds it and says it for every rank (over MPI), once
    assert count_errors(result.stdout, ["MASTER_ADDR='no-such-host.invalid' does not resolve"]) == 1
    assert "init failed on every rank" in result.stdout and "Traceback" not in result.stdout


@pytest.mark.timeout(60)
def test_port_in_use_is_one_error_said_once(tmp_path):
    """Every rank ends on it (rank 0's failure is broadcast over MPI), and rank 0 alone says it."""
    job = script(tmp_path, "comm.barrier()\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = clean_env(SPMD_BACKEND="gloo", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        result = run([MPIRUN, "-n", 2, PY, job], 50, env)
    assert result.returncode != 0
    assert count_errors(result.stdout, [f"127.0.0.1:{port}", "in use", "MASTER_PORT"]) == 1
    assert "init failed on every rank" in result.stdout and "Traceback" not in result.stdout


@pytest.mark.timeout(60)
def test_inconsistent_launcher_environment_is_explained(tmp_path):
    job = script(tmp_path, "comm.barrier()\n")
    env = clean_env(RANK="3", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29412")
    result = run([PY, "-m", "spmd", job], 50, env)
    assert result.returncode != 0
    assert "RANK" in result.stdout and "WORLD_SIZE" in result.stdout
