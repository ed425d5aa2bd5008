"""No socket a stranger can use: what a 2-rank job listens on, and an outsider at its store.

Every listening TCP socket of each rank is read from /proc; those the rank
shares with the processes above it are the launcher's (MPICH's mpiexec
leaves its control port, on every interface, open in its ranks), except
under spmd run, whose sockets are spmd's too.  docs/reliability.md,
"Sockets and strangers".
"""

import ipaddress
import json
import os
import re
import threading
import time

import pytest

from tests.support import MPIRUN, PY, WORLDS, clean_env, finish, start, tool
from tests.worlds.listening import listening as listening_of
from tests.worlds.stranger import banner, intrude

pytestmark = pytest.mark.launcher

SCRIPT = str(WORLDS / "sockets.py")
SPMD = tool("spmd")
LAUNCHERS = {
    "mpirun-gloo": ([str(MPIRUN), "-n", "2", PY], {"SPMD_BACKEND": "gloo"}),
    "mpirun-mpi": ([str(MPIRUN), "-n", "2", PY], {"SPMD_BACKEND": "mpi", "SPMD_TORCH_GROUP": "1"}),
    "spmd-run": ([str(SPMD), "run", "-n", "2"], {}),
    "spmd-run-preload": ([str(SPMD), "run", "-n", "2", "--preload", "torch"], {}),
    "torchrun": ([PY, "-m", "torch.distributed.run", "--nproc-per-node", "2"], {}),
}
OURS_ABOVE = {"spmd-run", "spmd-run-preload"}  # the launcher above the ranks is spmd's


def wildcard(host):
    return ipaddress.ip_address(host.split("%")[0]).is_unspecified


def sockets_of(out):
    found = {int(r): json.loads(text) for r, text in re.findall(r"SOCKETS (\d+) (\{.*\})", out)}
    assert sorted(found) == [0, 1], out[-3000:]
    return found


@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_no_socket_of_a_two_rank_job_listens_on_every_interface(launcher):
    cmd, env = LAUNCHERS[launcher]
    proc = start(cmd + [SCRIPT, "list"], clean_env(SPMD_TIMEOUT=60, **env))
    out = finish(proc, 120, f"{launcher} sockets.py list").stdout
    assert proc.returncode == 0, out[-3000:]
    found = sockets_of(out)
    for rank, seen in found.items():
        assert seen["sum"] == [1.0, 3.0, 5.0, 7.0], out[-3000:]  # the job did work over those sockets
        ours = dict(seen["own"], **(seen["inherited"] if launcher in OURS_ABOVE else {}))
        assert ours, f"rank {rank} listens on nothing of its own: the listing is broken\n{out[-2000:]}"
        wide = {inode: addr for inode, addr in ours.items() if wildcard(addr[0])}
        assert not wide, f"{launcher}: rank {rank} listens on every interface: {wide}\n{out[-3000:]}"


def outsider(text, alive, flags, probe_all, seconds=90):
    """Be the stranger at a job started with sockets.py outsider FLAGS: find rank 0's store while rank 1
    is held back in init, try it, let rank 1 go, try it again while the job runs, then let it end.
    text() is the job's output so far, alive() whether it runs; probe_all: rank 0's sockets from before
    its PID line are probed too (under spmd run the launcher bound the store's socket before)."""
    deadline = time.monotonic() + seconds
    try:
        while not re.search(r"PID 0 (\d+)", text()) and time.monotonic() < deadline and alive():
            time.sleep(0.05)
        found = re.search(r"PID 0 (\d+)", text())
        assert found, text()[-3000:]
        pid = int(found[1])
        before = set() if probe_all else set(map(tuple, listening_of(pid).values()))
        stores = []
        while not stores and time.monotonic() < deadline and alive():  # rank 0 now waits in init
            new = set(map(tuple, listening_of(pid).values())) - before
            stores = [a for a in new if banner(*a).startswith(b"SPMD-STORE")]
            time.sleep(0.05)
        assert stores, f"rank 0 served no store while rank 1 was held back:\n{text()[-3000:]}"
        (store,) = stores
        assert not wildcard(store[0]), store
        got = intrude(*store)
        assert not got, f"during init an outsider got through: {got}"
        (flags / "init").touch()
        while text().count("RUNNING rank") < 2 and time.monotonic() < deadline:
            assert alive(), text()[-3000:]
            time.sleep(0.05)
        got = intrude(*store)
        assert not got, f"during the run an outsider got through: {got}"
    finally:
        (flags / "init").touch()
        (flags / "run").touch()


REFUSED = re.compile(r"the job store closed a connection from \S+ that did not prove it belongs to the job")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("launcher", ["mpirun-gloo", "spmd-run"])
def test_an_outsider_at_the_store_during_init_and_the_run_changes_nothing(launcher, tmp_path):
    cmd, env = LAUNCHERS[launcher]
    proc = start(cmd + [SCRIPT, "outsider", str(tmp_path)], clean_env(SPMD_TIMEOUT=90, **env))
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        outsider(lambda: "".join(lines), lambda: proc.poll() is None, tmp_path, launcher in OURS_ABOVE)
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(5)
    out = "".join(lines)
    assert code == 0, out[-3000:]
    assert all(seen["sum"] == [1.0, 3.0, 5.0, 7.0] for seen in sockets_of(out).values()), out[-3000:]
    assert REFUSED.search(out), out[-3000:]
