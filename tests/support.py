"""What the tests share: real multi-process jobs with a hard time limit, launcher tools, in-process worlds.

Every test module imports from here (``from tests.support import ...``); tests/conftest.py
holds only pytest's hooks (the tiers, a clean environment) and the shared fixtures.
"""


import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WORLDS = REPO / "tests" / "worlds"
PY = sys.executable
BIN = Path(PY).parent


# CI (.ci/run) sets SPMD_REQUIRE_OPENMPI=1: there, what a test needs and does not find
# (Open MPI, MPICH's mpirun, the SLURM cluster, a CPU-only host) is a failure, not a skip.
CI = os.environ.get("SPMD_REQUIRE_OPENMPI") == "1"


def missing(reason):
    """Skip a test this host cannot run, saying why; in CI fail instead."""
    if CI:
        pytest.fail(f"CI (SPMD_REQUIRE_OPENMPI=1) runs every test, but: {reason}")
    pytest.skip(reason)


# The variables by which a launcher places a process: the pytest process itself runs alone
# (a world of one) whatever started it, so in-process tests do not depend on the shell.
PLACEMENT = ("PMI_", "PMIX_", "OMPI_", "MV2_", "MPI_LOCAL", "SLURM_", "GROUP_", "ROLE_",
             "TORCHELASTIC_", "SPMD_RANK", "SPMD_SIZE", "SPMD_LOCAL_", "SPMD_NODE_RANK",
             "SPMD_NUM_NODES", "SPMD_LISTEN_FD")
PLACEMENT_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def tool(name):
    """Return the path of a command from this environment's bin, else PATH."""
    here = BIN / name
    return str(here) if here.exists() else shutil.which(name)


MPIRUN = tool("mpirun")


def clean_env(**extra):
    """Return os.environ without launcher variables, plus extra."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SPMD_", "PMI_", "OMPI_", "PMIX_", "MV2_", "SLURM_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    # Unbuffered, print() writes text and newline separately, and mpirun may
    # interleave another rank's output between them: keep stdout buffered.
    env.pop("PYTHONUNBUFFERED", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    # Hermetic on a GPU machine: no test world may see CUDA, or auto would pick nccl
    # where a test expects gloo or mpi. A test that wants a GPU passes its own value.
    env["CUDA_VISIBLE_DEVICES"] = ""
    # The same output on any machine: no hint that depends on its number of CPUs (tests of the
    # hints pass SPMD_HINTS=1).
    env["SPMD_HINTS"] = "0"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start(cmd, env=None, cwd=REPO):
    """Start cmd in its own session so that it and its children can be killed."""
    return subprocess.Popen(
        [str(c) for c in cmd],
        env=env or clean_env(),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc, timeout, what="job"):
    """Wait for proc; on timeout kill its whole session and fail with its output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        pytest.fail(f"{what} hung: no exit within {timeout} s; output so far:\n{out[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def marked(mark):
    """Return {pid: command line} of the live processes (not this one) whose command line or
    environment holds mark: a word unique to one run, so what it leaves behind can be found."""
    needle, found = mark.encode(), {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            environ = Path(f"/proc/{name}/environ").read_bytes()  # empty for a zombie
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if needle in cmdline or needle in environ:
            found[int(name)] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
    return found


def left_behind(mark, grace=1.0):
    """Return {pid: command line} of mark's processes still alive grace seconds after now; kill them.

    Call it once the run's launcher has exited: a process that outlives it by more
    than grace was left behind.  SIGKILL ends each one, so nothing leaks into later tests.
    """
    deadline = time.monotonic() + grace
    found = marked(mark)
    while found and time.monotonic() < deadline:
        time.sleep(0.05)
        found = marked(mark)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return found


#: What a job's script prints where a promise starts (a rank about to raise, to wait, to be killed):
#: CLOCK_MONOTONIC is one clock for every process of the host, so the test can time the run from there,
#: never from the launcher's start, which counts interpreter start and ``import torch``.
PROMISE = 'print("SPMD-PROMISE-AT", __import__("time").monotonic(), flush=True)'
_PROMISED = re.compile(r"SPMD-PROMISE-AT (\d+\.\d+)")


def since_promise(out, ended=None):
    """Seconds from the first promise line in out to ended (default: now); None when none was printed."""
    times = [float(t) for t in _PROMISED.findall(out)]
    if not times:
        return None
    return (time.monotonic() if ended is None else ended) - min(times)


def run(cmd, timeout=120, env=None, what=None):
    """Run cmd to completion with a hard timeout; return the CompletedProcess."""
    return finish(start(cmd, env), timeout, what or " ".join(map(str, cmd[:6])))


# Hydra forwards each rank's output in chunks, so a line may run into the next rank's.
CHECKS = re.compile(r"CHECKS OK (\d+) rank (\d+) size (\d+) backend ([a-z]+) launcher ([a-z]+?)(?=CHECKS|\W|$)")


def checks_passed(out):
    """Return {rank: (count, size, backend, launcher)} from world-check output."""
    return {int(m[2]): (int(m[1]), int(m[3]), m[4], m[5]) for m in CHECKS.finditer(out)}


def assert_world(result, size, backend=None, launcher=None):
    """Assert every rank of a world check passed, with the expected labels."""
    got = checks_passed(result.stdout)
    assert result.returncode == 0 and sorted(got) == list(range(size)), (
        f"exit {result.returncode}, ranks reporting {sorted(got)} of {size}:\n{result.stdout[-4000:]}"
    )
    for rank, (count, n, b, l) in got.items():
        assert n == size and count > 50, (rank, count, n)
        assert backend is None or b == backend, (rank, b, backend)
        assert launcher is None or l == launcher, (rank, l, launcher)
    return got


# -- fixtures shared by the in-process tiers ---------------------------------------------

#: Backends a test can open in one process (a world of one); "torch" is torch.distributed's
#: general path on the gloo group (what nccl and torch's mpi take).
IN_PROCESS_BACKENDS = ["serial", "gloo", "torch", "mpi"]


def open_comm(backend, monitor):
    """Open an in-process communicator of backend (a world of one); gloo and torch need gloo_group."""
    from spmd.config.placement import Placement

    placement = Placement(rank=0, size=1, local_rank=0, local_size=1, node_rank=0, num_nodes=1, launcher="none")
    from spmd.comms.comm import Comm

    return Comm(open_backend(backend), placement, monitor)


def open_backend(backend):
    """Open an in-process backend object (a world of one); gloo and torch need gloo_group."""
    if backend == "serial":
        from spmd.comms.backends.serial import SerialBackend

        return SerialBackend()
    if backend == "mpi":
        from mpi4py import MPI

        from spmd.comms.backends.mpi.backend import MpiBackend

        return MpiBackend(MPI.COMM_SELF, 60.0)
    from spmd.comms.backends.torchdist.backend import TorchBackend
    from spmd.comms.backends.torchdist.gloo import GlooBackend

    cls = GlooBackend if backend == "gloo" else TorchBackend
    return cls("gloo", timeout=60.0)


# -- a world of threads: ranks that are threads of this process ------------------------------


class ThreadWorld:
    """What the ranks of a world of threads share: one mailbox per collective."""

    def __init__(self, size):
        self.size = size
        self.cond = threading.Condition()
        self.boxes = {}  # collective number -> objects in rank order
        self.failed = False
        self.calls = [[] for _ in range(size)]

    def exchange(self, number, rank, obj):
        """Post obj for collective number; return every rank's object."""
        with self.cond:
            box = self.boxes.setdefault(number, [None] * self.size + [0])
            box[rank] = obj
            box[-1] += 1
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: box[-1] == self.size or self.failed, timeout=20):
                raise TimeoutError(f"rank {rank}: collective {number} incomplete after 20 s")
            if box[-1] < self.size:
                raise RuntimeError(f"rank {rank}: another rank failed")
            return box[: self.size]

    def fail(self):
        with self.cond:
            self.failed = True
            self.cond.notify_all()


class ThreadComm:
    """The part of the Comm interface DataParallel uses, between threads (tensors: torch)."""

    backend = "threads"

    def __init__(self, world, rank):
        self.world, self.rank, self.size = world, rank, world.size
        self._count = 0

    def _exchange(self, obj):
        self._count += 1
        return self.world.exchange(self._count, self.rank, obj)

    def all_reduce(self, x, op="sum", async_op=False):
        from spmd.comms.handle import Done  # here: importing tests.support imports no spmd module

        assert op == "sum"
        self.world.calls[self.rank].append((x.numel(), x.dtype))
        parts = self._exchange(x.clone())
        total = parts[0].clone()
        for p in parts[1:]:
            total += p  # in rank order on every rank: identical results
        x.copy_(total)
        return Done(x) if async_op else x

    def broadcast(self, x, root=0, async_op=False):
        from spmd.comms.handle import Done

        x.copy_(self._exchange(x.clone())[root])
        return Done(x) if async_op else x

    def all_gather(self, x, async_op=False, *, equal=False):
        from spmd.comms.handle import Done

        self.world.calls[self.rank].append(("all_gather", x.numel(), x.dtype))
        parts = [p.clone() for p in self._exchange(x.clone())]
        if equal:
            assert len({p.shape for p in parts}) == 1, [p.shape for p in parts]
        return Done(parts) if async_op else parts

    def broadcast_object(self, obj, root=0):
        return self._exchange(obj)[root]

    def gather_object(self, obj, root=0):
        out = self._exchange(obj)
        return out if self.rank == root else None

    def all_gather_object(self, obj):
        return self._exchange(obj)


def run_ranks(size, fn):
    """Run fn(comm) on size threads; return (results, errors, world), in rank order."""
    world = ThreadWorld(size)
    results, errors = [None] * size, [None] * size

    def body(rank):
        try:
            results[rank] = fn(ThreadComm(world, rank))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors[rank] = exc
            world.fail()  # release ranks waiting for this one

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank is stuck"
    return results, errors, world


def ranks_ok(outcome):
    """Return (results, world) of a run_ranks outcome; raise the first rank's error, if any."""
    results, errors, world = outcome
    for e in errors:
        if e is not None:
            raise e
    return results, world


def hydra_files():
    """MPICH's mpiexec topology files of this user's: /tmp/hydra_hwloc_xmlfile_*.

    mpiexec (MPICH 5.0.2) writes one per job for its proxies and removes it at
    exit, except after MPI_Abort or when killed: then it stays (tests/tools/soak.py, "mpirun files").
    """
    found = []
    for path in glob.glob("/tmp/hydra_hwloc_xmlfile_*"):
        try:
            if os.lstat(path).st_uid == os.getuid():
                found.append(path)
        except OSError:
            pass
    return found
