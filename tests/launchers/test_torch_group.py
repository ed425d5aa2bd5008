"""torch.distributed is usable after spmd.init under every launcher.

On gloo and nccl spmd's comm is a torch.distributed group already; on the
mpi backend (mpi4py) init starts torch.distributed's default group beside
MPI when torch is imported (SPMD_TORCH_GROUP / torch_group= say otherwise).
tests/worlds/torch_tutorial.py runs PyTorch's tutorial "Writing Distributed
Applications with PyTorch" after spmd.init(); DDP under mpirun must train
exactly like torch's own DDP under torchrun.
"""

import re

import pytest

from tests.support import MPIRUN, PY, WORLDS, clean_env, run, tool

TUTORIAL = WORLDS / "torch_tutorial.py"
DDP = WORLDS / "ddp_train.py"
OK = re.compile(r"TUTORIAL OK rank (\d) size (\d) backend ([a-z]+) torch ([a-z]+)")

pytestmark = pytest.mark.skipif(MPIRUN is None, reason="mpirun not found: pip install mpich")


def assert_tutorial(result, size, backend):
    got = {int(m[1]): (int(m[2]), m[3], m[4]) for m in OK.finditer(result.stdout)}
    assert result.returncode == 0 and sorted(got) == list(range(size)), (
        f"exit {result.returncode}, ranks {sorted(got)} of {size}:\n{result.stdout[-4000:]}"
    )
    assert set(got.values()) == {(size, backend, "gloo")}, got
    assert "terminate called" not in result.stdout, result.stdout[-4000:]


@pytest.mark.launcher
@pytest.mark.timeout(120)
def test_tutorial_under_mpirun_on_the_mpi_backend():
    result = run([MPIRUN, "-n", 2, PY, TUTORIAL], 110)
    assert_tutorial(result, 2, "mpi")


@pytest.mark.launcher
@pytest.mark.timeout(120)
def test_tutorial_under_mpirun_on_gloo():
    result = run([MPIRUN, "-n", 2, PY, "-m", "spmd", TUTORIAL], 110, clean_env(SPMD_BACKEND="gloo"))
    assert_tutorial(result, 2, "gloo")


@pytest.mark.launcher
@pytest.mark.timeout(120)
def test_tutorial_under_spmd_run():
    result = run([tool("spmd"), "run", "-n", 2, TUTORIAL], 110)
    assert_tutorial(result, 2, "gloo")


@pytest.mark.launcher
@pytest.mark.timeout(120)
def test_tutorial_under_torchrun():
    result = run([tool("torchrun"), "--nproc-per-node", 2, "-m", "spmd", TUTORIAL], 110)
    assert_tutorial(result, 2, "gloo")


def mpirun_script(tmp_path, text, *args):
    """Write text as tmp_path/job.py and run it under mpirun -n 2 (the mpi backend); return the result."""
    script = tmp_path / "job.py"
    script.write_text(text)
    return run([MPIRUN, "-n", 2, PY, script, *args], 110)


@pytest.mark.launcher
@pytest.mark.timeout(120)
def test_torch_group_off_leaves_torch_distributed_uninitialised():
    env = clean_env(SPMD_TORCH_GROUP="0")
    result = run([MPIRUN, "-n", 2, PY, TUTORIAL, "--expect-uninitialized"], 110, env)
    assert result.returncode == 0 and result.stdout.count("TUTORIAL SKIPPED") == 2, result.stdout[-4000:]


@pytest.mark.launcher
@pytest.mark.timeout(120)
def test_torch_group_on_imports_torch_and_auto_without_torch_does_not(tmp_path):
    # auto in a script that never imported torch: no group, no torch (a numpy-only script).
    # torch_group=True: torch is imported and the group started.
    text = (
        "import sys\nimport spmd\n"
        "on = sys.argv[1] == 'on'\n"
        "spmd.init(torch_group=True if on else None)\n"
        "loaded = 'torch' in sys.modules\n"
        "up = loaded and __import__('torch.distributed').distributed.is_initialized()\n"
        "print('STATE', spmd.comm.backend, loaded, up, flush=True)\n"
    )
    for arg, state in (("auto", "mpi False False"), ("on", "mpi True True")):
        result = mpirun_script(tmp_path, text, arg)
        assert result.returncode == 0, result.stdout[-4000:]
        assert re.findall(r"STATE (\w+ \w+ \w+)", result.stdout) == [state] * 2, (arg, result.stdout)


@pytest.mark.launcher
@pytest.mark.timeout(120)
def test_a_group_the_user_started_first_is_left_alone(tmp_path):
    result = mpirun_script(
        tmp_path,
        "import os, torch, torch.distributed as dist\nimport spmd\n"
        "rank, size = int(os.environ['PMI_RANK']), int(os.environ['PMI_SIZE'])\n"
        f"store = dist.FileStore({str(tmp_path / 'store')!r}, size)\n"
        "dist.init_process_group('gloo', store=store, rank=rank, world_size=size)\n"
        "mine = dist.group.WORLD\n"
        "spmd.init()\n"
        "assert dist.group.WORLD is mine\n"
        "spmd.finalize()\n"
        "assert dist.is_initialized() and dist.group.WORLD is mine\n"
        "t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == size, t\n"
        "del mine\ndist.destroy_process_group()\n"
        "print('USER GROUP KEPT', rank, flush=True)\n",
    )
    assert result.returncode == 0 and result.stdout.count("USER GROUP KEPT") == 2, result.stdout[-4000:]


@pytest.mark.launcher
@pytest.mark.timeout(120)
def test_finalize_destroys_the_group_and_init_starts_a_new_one(tmp_path):
    result = mpirun_script(
        tmp_path,
        "import torch, torch.distributed as dist\nimport spmd\n"
        "for round in range(2):\n"
        "    spmd.init()\n"
        "    t = torch.ones(1)\n    dist.all_reduce(t)\n    assert t.item() == spmd.comm.size\n"
        "    spmd.finalize()\n"
        "    assert not dist.is_initialized()\n"
        "print('ROUNDS OK', flush=True)\n",
    )
    assert result.returncode == 0 and result.stdout.count("ROUNDS OK") == 2, result.stdout[-4000:]


STEPS, BATCH = 6, 16


@pytest.mark.launcher
@pytest.mark.timeout(400)
def test_ddp_under_mpirun_trains_like_ddp_under_torchrun(tmp_path):
    torch = pytest.importorskip("torch")
    common = ["--steps", STEPS, "--global-batch", BATCH, "--optimizer", "sgd"]
    ref, ours = tmp_path / "torchrun.pt", tmp_path / "mpirun.pt"
    result = run([tool("torchrun"), "--standalone", "--nproc-per-node", 2, DDP, ref] + common,
                 150, env=clean_env(OMP_NUM_THREADS=1), what="torch DDP under torchrun")
    assert result.returncode == 0 and result.stdout.count("DDP OK") == 2, result.stdout[-4000:]
    result = run([MPIRUN, "-n", 2, PY, DDP, ours, "--spmd-init"] + common,
                 150, env=clean_env(OMP_NUM_THREADS=1), what="torch DDP under mpirun after spmd.init")
    assert result.returncode == 0 and result.stdout.count("DDP OK") == 2, result.stdout[-4000:]
    assert "terminate called" not in result.stdout
    a, b = torch.load(ref), torch.load(ours)
    assert a.keys() == b.keys()
    # The same gloo all-reduce of the same gradients: bit for bit equal.
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different
