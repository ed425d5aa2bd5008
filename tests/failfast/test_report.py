"""One report per job: an error every rank raises alike is printed
in full once, and a hang (or SIGUSR2) prints where every rank is, grouped.

The unit tests run rank 0's Hub in this process with sockets playing the other ranks, as
tests/failfast/test_hub.py does; the launcher tests run tests/worlds/faults.py's mismatch and
tests/worlds/report.py's scenarios.
"""

import json
import os
import re
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.support import MPIRUN, PY, WORLDS, clean_env, finish, start, tool
from spmd.failfast import abort
from spmd.failfast.report import SignalReport, digest, normalise, stacks_text, where
from spmd.failfast.hub import PEER_EXIT, WINDOW, open_hub

needs_mpirun = pytest.mark.skipif(MPIRUN is None, reason="mpirun not found: pip install mpich")


# -- the digest ----------------------------------------------------------------------

@pytest.mark.unit
def test_errors_alike_but_for_rank_numbers_pids_and_addresses_have_one_digest():
    def timeout(rank, gloo, seen):
        return TimeoutError(
            f"rank {rank}: all_reduce (call #12) timed out after 6 s waiting for the other ranks (gloo: "
            f"{gloo}). Timed out too: {seen}; ranks [1] never arrived (pid {1000 + rank})")

    a = timeout(0, "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 6000ms for recv operation",
                "rank 0 in #12 all_reduce, rank 2 in #12 all_reduce")
    b = timeout(3, "[../gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:5555: Connection reset by peer",
                "rank 0 in #12 all_reduce, rank 2 in #12 all_reduce, rank 3 in #12 all_reduce")
    assert normalise(str(a)) == normalise(str(b))
    assert digest(TimeoutError, a) == digest(TimeoutError, b)
    assert "rank N: all_reduce (call #12)" in normalise(str(a))


@pytest.mark.unit
def test_errors_of_another_type_or_call_have_another_digest():
    e = ValueError("rank 1 found a bad record")
    assert digest(ValueError, e) == digest(ValueError, ValueError("rank 7 found a bad record"))
    assert digest(ValueError, e) != digest(KeyError, KeyError("rank 1 found a bad record"))
    assert digest(ValueError, e) != digest(ValueError, ValueError("rank 1 found a bad header"))
    assert digest(ValueError, ValueError("call #2")) != digest(ValueError, ValueError("call #3"))


class FakeRelay:
    def __init__(self, answer):
        self.answer, self.asked, self.done = answer, [], False

    def judge(self, digest):
        self.asked.append(digest)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def judged(self):
        self.done = True


@pytest.fixture
def relay():
    def make(answer, rank=3):
        fake = FakeRelay(answer)
        abort.register(rank, 4, (), fake)
        return fake

    yield make
    abort.unregister()


@pytest.mark.unit
@pytest.mark.parametrize("answer, full", [(0, False), (3, True), (None, True), (OSError("hub gone"), True)])
def test_a_rank_prints_one_line_only_when_the_hub_names_another_rank(relay, capsys, answer, full):
    fake = relay(answer)
    try:
        raise ValueError("rank 3 found a bad record")
    except ValueError:
        lead = abort.report_failure(*sys.exc_info())
    err = capsys.readouterr().err
    assert fake.asked == [digest(ValueError, ValueError("rank 0 found a bad record"))] and fake.done
    if full:  # its own report: in full, never lost
        assert lead is None and "Traceback" in err and "ValueError: rank 3 found a bad record" in err
    else:
        assert lead == 0 and err.count("\n") == 1
        assert err.startswith("### spmd: rank 3: same error as rank 0 (ValueError; rank 3 of 4 on ")


@pytest.mark.unit
def test_a_message_not_raised_is_compared_as_an_error_of_its_kind(relay, capsys):
    fake = relay(1)
    assert abort.report_message("### spmd: rank 3 of 4: all_reduce (call #2) timed out") == 1
    assert "rank 3: same error as rank 1 (CollectiveTimeout;" in capsys.readouterr().err
    relay(None)
    assert abort.report_message("### spmd: rank 3 of 4: all_reduce (call #2) timed out") is None
    assert capsys.readouterr().err == "### spmd: rank 3 of 4: all_reduce (call #2) timed out\n"
    assert len(set(fake.asked)) == 1


# -- the hub's FULL / SAME ---------------------------------------------------------------

SIZE = 4


@pytest.fixture
def hub(exits):
    shared = []
    hub = open_hub(0, SIZE, lambda v: shared.append(v) or v, True, 5)
    hub.secret = shared[0].split(" ")[1]
    yield hub
    hub.close()
    assert not hub._thread.is_alive()


def rank_socket(hub, rank):
    sock = socket.create_connection(hub.address, timeout=5)
    sock.sendall(f"HELLO {rank} {hub.secret}\n".encode())
    return sock


def read_line(sock, seconds=5.0):
    sock.settimeout(seconds)
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk:
            break
        data += chunk
    return data.rstrip(b"\n")


@pytest.mark.unit
def test_the_lowest_rank_with_an_error_prints_it_and_the_others_say_same(hub, exits):
    socks = {r: rank_socket(hub, r) for r in (1, 2, 3)}
    alike, other = digest(ValueError, ValueError("x")), digest(KeyError, KeyError("y"))
    for r in (2, 1):
        socks[r].sendall(f"ERR {alike}\n".encode())
    socks[3].sendall(f"ERR {other}\n".encode())
    began = time.monotonic()
    assert hub.judge(alike) == 0  # rank 0 failed alike, too
    assert time.monotonic() - began < WINDOW + 1.0
    assert read_line(socks[1]) == b"SAME 0"
    assert read_line(socks[2]) == b"SAME 0"
    assert read_line(socks[3]) == b"FULL"  # a different error: its own report
    late = rank_socket(hub, 1)  # (a second connection as rank 1, for a late failure)
    late.sendall(f"ERR {alike}\nERR {digest(OSError, OSError('z'))}\n".encode())
    assert read_line(late) == b"SAME 0"  # after the window: answered at once
    assert read_line(late) == b"FULL"
    hub.judged()
    assert exits.empty()
    for s in [late, *socks.values()]:
        s.close()


@pytest.mark.unit
def test_without_rank_0_the_lowest_failing_rank_prints(hub, exits):
    socks = {r: rank_socket(hub, r) for r in (2, 3)}
    alike = digest(ValueError, ValueError("x"))
    socks[3].sendall(f"ERR {alike}\n".encode())
    time.sleep(WINDOW / 4)
    socks[2].sendall(f"ERR {alike}\n".encode())
    assert read_line(socks[2]) == b"FULL"
    assert read_line(socks[3]) == b"SAME 2"
    for s in socks.values():
        s.close()


@pytest.mark.unit
def test_an_abort_waits_for_this_ranks_own_report(hub, exits):
    sock = rank_socket(hub, 1)
    judged = threading.Thread(target=hub.judge, args=(digest(ValueError, ValueError("x")),))
    judged.start()
    time.sleep(0.1)
    sock.sendall(b"FAIL\n")  # another rank ends the job while rank 0 writes its report
    assert read_line(sock) == b"ABORT"
    with pytest.raises(queue.Empty):
        exits.get(timeout=0.5)
    hub.judged()
    assert exits.get(timeout=5)[0] == PEER_EXIT
    judged.join(5)
    sock.close()


@pytest.mark.unit
def test_err_without_the_secret_is_junk(hub, exits):
    sock = socket.create_connection(hub.address, timeout=5)
    sock.sendall(b"ERR 00ff\n")
    sock.settimeout(5)
    assert sock.recv(64) == b""  # dropped at once, never answered
    assert hub.judge("00ff", timeout=WINDOW + 1.0) == 0
    assert exits.empty()


# -- where every rank is --------------------------------------------------------------------

@pytest.mark.unit
def test_the_stacks_report_groups_ranks_by_where_they_wait():
    def s(r, call, place, func, threads="Thread MainThread:\n  same\n"):
        return {"rank": r, "host": "h", "pid": 100 + r, "where": place, "func": func, "call": call,
                "threads": threads}

    summaries = {r: s(r, "all_reduce #12", "train.py:40", "step") for r in (0, 2, 3)}
    summaries[1] = s(1, None, "train.py:77", "save", "Thread MainThread:\n  other\n")
    text = stacks_text(summaries, 4, "a call timed out on rank 2")
    assert "3 of 4 ranks wait in all_reduce #12 at train.py:40 (ranks 0, 2, 3);" in text
    assert "rank 1 is at train.py:77 in save()" in text
    assert text.count("  same\n") == 1 and "--- ranks 0, 2, 3 " in text and "--- rank 1 " in text
    del summaries[3]
    assert "rank 3 did not answer within 2 s" in stacks_text(summaries, 4, waited=2)


class FakeMonitor:
    busy = 12

    @staticmethod
    def find(seq):
        return (seq, "all_reduce", None, "sum", None, (), None)


@pytest.mark.unit
def test_a_rank_says_its_innermost_frame_outside_spmd_and_its_call():
    here = where(0, [FakeMonitor()])
    assert here["where"].startswith("tests/failfast/test_report.py:") or "test_report.py:" in here["where"]
    assert here["func"] == "test_a_rank_says_its_innermost_frame_outside_spmd_and_its_call"
    assert here["call"] == "all_reduce #12"
    json.dumps(here)  # what travels to the hub


@pytest.mark.unit
def test_rank_0_gathers_every_ranks_stacks_and_prints_one_report(hub, exits, capsys):
    hub.monitors = [FakeMonitor()]
    socks = {r: rank_socket(hub, r) for r in (1, 2)}  # rank 3 never answers
    time.sleep(0.2)  # greeted
    got = []
    asker = threading.Thread(target=lambda: got.append(hub.stacks_report(timeout=1.0)))
    asker.start()
    for r, sock in socks.items():
        assert read_line(sock) == b"STACKS"
        summary = {"rank": r, "host": "h", "pid": r, "where": "train.py:77" if r == 1 else "x.py:1",
                   "func": "save", "call": None, "threads": "Thread MainThread:\n"}
        data = json.dumps(summary).encode()
        sock.sendall(b"STACK %d\n" % len(data) + data)
    asker.join(10)
    text = got[0]
    assert "where the 4 ranks are (a call timed out on rank 0)" in text
    assert "rank 0 waits in all_reduce #12 at " in text
    assert "rank 1 is at train.py:77 in save()" in text
    assert "rank 3 did not answer within 1 s" in text
    assert capsys.readouterr().err.count("where the 4 ranks are") == 1  # printed by rank 0, once
    # a rank asks too, soon after: the same report comes back, not printed again
    socks[2].sendall(b"WHERE timeout 1000\n")
    head = read_line(socks[2])
    assert head.startswith(b"REPORT ")
    assert capsys.readouterr().err == ""
    assert exits.empty()
    for s in socks.values():
        s.close()


@pytest.mark.unit
def test_sigusr2_calls_the_trigger_from_a_thread_of_its_own():
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    fired = threading.Event()
    guard = SignalReport(fired.set)
    try:
        assert guard.installed
        os.kill(os.getpid(), signal.SIGUSR2)
        assert fired.wait(5)
    finally:
        guard.close()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    assert signal.set_wakeup_fd(-1) == -1


@pytest.mark.unit
def test_sigusr2_is_left_to_a_handler_of_the_users_and_to_the_main_thread():
    mine = lambda signum, frame: None  # noqa: E731
    previous = signal.signal(signal.SIGUSR2, mine)
    try:
        assert not SignalReport(lambda: None).installed
        assert signal.getsignal(signal.SIGUSR2) is mine
    finally:
        signal.signal(signal.SIGUSR2, previous)
    elsewhere = []
    t = threading.Thread(target=lambda: elsewhere.append(SignalReport(lambda: None).installed))
    t.start()
    t.join()
    assert elsewhere == [False] and signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


# -- real jobs ----------------------------------------------------------------------------

FAULTS = WORLDS / "faults.py"
REPORT = WORLDS / "report.py"
LAUNCHERS = {
    "mpirun": lambda n: [MPIRUN, "-n", n, PY, "-m", "spmd"],
    "spmd-run": lambda n: [tool("spmd"), "run", "-n", n],
}


def play(launcher, size, world, scenario, timeout, **env):
    proc = start(LAUNCHERS[launcher](size) + [world, scenario], clean_env(**env))
    return finish(proc, timeout, f"{launcher} -n {size} {world.name} {scenario}")


def assert_once(out, size, lead=0):
    assert out.count("collective mismatch at call #2 (broadcast on rank 0)") == 1, out[-4000:]
    assert out.count("Traceback (most recent call last)") == 1, out[-4000:]
    for r in range(size):
        if r != lead:
            assert f"rank {r}: same error as rank {lead}" in out, out[-4000:]


@needs_mpirun
@pytest.mark.launcher
@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_mismatch_in_debug_mode_is_reported_once_at_4_ranks(launcher):
    result = play(launcher, 4, FAULTS, "mismatch", 200, SPMD_DEBUG=1, SPMD_TIMEOUT=60)
    assert result.returncode == 1, result.stdout[-4000:]
    assert_once(result.stdout, 4)


@needs_mpirun
@pytest.mark.launcher
@pytest.mark.timeout(400)
def test_a_mismatch_in_debug_mode_is_reported_once_at_8_ranks():
    result = play("mpirun", 8, FAULTS, "mismatch", 360, SPMD_DEBUG=1, SPMD_TIMEOUT=120)
    assert result.returncode == 1, result.stdout[-4000:]
    out = result.stdout
    assert out.count("collective mismatch at call #2 (broadcast on rank 0)") == 1, out[-4000:]
    assert out.count("Traceback (most recent call last)") == 1, out[-4000:]


@needs_mpirun
@pytest.mark.launcher
@pytest.mark.timeout(240)
def test_a_rank_with_a_different_error_prints_its_own_traceback():
    result = play("mpirun", 4, REPORT, "two-errors", 200, SPMD_TIMEOUT=60)
    out = result.stdout
    assert result.returncode == 1, out[-4000:]
    assert out.count("ValueError: rank 0 found a bad record") == 1, out[-4000:]
    assert "KeyError: 'rank 1 has no such column'" in out, out[-4000:]
    assert "rank 2: same error as rank 0" in out and "rank 3: same error as rank 0" in out, out[-4000:]
    assert out.count("Traceback (most recent call last)") == 2, out[-4000:]


@needs_mpirun
@pytest.mark.launcher
@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", ["spmd-run", "mpirun"])  # gloo; mpi (its timeout thread asks)
def test_a_hang_prints_where_every_rank_is(launcher):
    result = play(launcher, 3, REPORT, "hang", 200, SPMD_TIMEOUT=6)
    out = result.stdout
    assert result.returncode != 0, out[-4000:]
    assert out.count("### spmd: where the 3 ranks are (a call timed out on rank ") == 1, out[-4000:]
    assert "2 of 3 ranks wait in all_reduce #2 at tests/worlds/report.py:29 (ranks 0, 2)" in out, out[-4000:]
    assert "rank 1 is at tests/worlds/report.py:28 in <module>()" in out, out[-4000:]
    assert "Thread MainThread:" in out, out[-4000:]
    if launcher == "spmd-run":
        assert out.count("CollectiveTimeout: rank 0: all_reduce (call #2) timed out after 6 s") == 1, out[-4000:]
    else:  # the mpi watcher's report: the first rank to time out prints it, the other says same
        assert len(re.findall(r"### spmd: rank [02] of 3: all_reduce \(call #2\) timed out after 6 s", out)) == 1, out[-4000:]
    assert re.search(r"rank [02]: same error as rank [02] \(CollectiveTimeout", out), out[-4000:]  # a timeout seen alike


def asleep(pids, seconds=30):
    """Wait until each pid's main thread has blocked (state S) twice in a row, 50 ms apart: past its READY
    line, which a rank descheduled on a loaded machine may still be inside when the line arrives."""
    deadline, calm = time.monotonic() + seconds, 0
    while calm < 2 and time.monotonic() < deadline:
        states = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                states.append("gone")
        calm = calm + 1 if all(state == "S" for state in states) else 0
        time.sleep(0.05)


@needs_mpirun
@pytest.mark.launcher
@pytest.mark.timeout(240)
def test_sigusr2_prints_where_every_rank_is_and_the_job_goes_on():
    proc = start(LAUNCHERS["mpirun"](2) + [REPORT, "usr2"], clean_env(SPMD_TIMEOUT=60))
    lines, ready = [], {}
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("READY rank "):
            ready[line.split()[2]] = int(line.split()[-1])
        if len(ready) == 2:  # both printed; once both main threads block, they sleep at line 31
            asleep(ready.values())
            os.kill(ready["1"], signal.SIGUSR2)
            break
    # The rest from the same file object: communicate() would read the pipe beneath
    # it and lose what this iteration had already buffered.
    rest = []
    reader = threading.Thread(target=lambda: rest.append(proc.stdout.read()), daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        pytest.fail("mpirun -n 2 report.py usr2 did not end within 200 s:\n" + "".join(lines)[-4000:])
    reader.join(timeout=10)
    out = "".join(lines + rest)
    assert code == 0, out[-4000:]
    assert "### spmd: where the 2 ranks are (SIGUSR2 on rank 1)" in out, out[-4000:]
    assert "2 of 2 ranks are at tests/worlds/report.py:31 in <module>() (ranks 0, 1)" in out, out[-4000:]
    assert "DONE rank 0" in out and "DONE rank 1" in out, out[-4000:]
