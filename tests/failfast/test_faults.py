"""Failures become errors, not hangs: each scenario under each launcher, with a time bound.

tests/worlds/faults.py plays one scenario; here each run must end non-zero
with the expected message within its bound, measured from the moment every
rank was ready (or from the start, for a rank that never starts).
"""

import collections
import os
import re
import signal
import threading
import time
import uuid
from typing import NamedTuple

import pytest

from tests.support import MPIRUN, PY, WORLDS, clean_env, left_behind, since_promise, start, tool

pytestmark = pytest.mark.launcher

FAULTS = WORLDS / "faults.py"
TIMEOUT = 6  # SPMD_TIMEOUT for these runs, in seconds
CRASH = 10  # bound for a failure that needs no timeout
HANG = TIMEOUT + 5  # bound for one found by a timeout

LAUNCHERS = {
    "mpirun": lambda n: [MPIRUN, "-n", n, PY, "-m", "spmd"],
    "spmd-run": lambda n: [tool("spmd"), "run", "-n", n],
    "torchrun": lambda n: [tool("torchrun"), "--nproc-per-node", n, "-m", "spmd"],
}
# spmd run with its ranks forked from a server that imported torch (tests/launch/test_forkserver.py),
# in a selection of the scenarios: failures, deaths, timeouts, the hub fuzzed (~40 s in all).
PRELOADED = "spmd-run-preload"
VARIANTS = {PRELOADED: lambda n: [tool("spmd"), "run", "--preload", "torch", "-n", n]}


class Run(NamedTuple):
    code: int  # the launcher's exit status
    out: str  # its output, every rank's
    seconds: float  # from every rank ready (else from the first rank entering init) to the launcher's exit
    left: dict  # {pid: command line} of the run's processes alive 1 s after that exit


def play(launcher, scenario, size=2, script=FAULTS, react=None, strict=True, **env):
    """Run one scenario (of faults.py, or of a copy of it at script) and return its Run.

    Every process of the run carries a unique mark (in its environment; the ranks also
    on their command line); once the launcher has exited, any still alive after 1 s is
    killed, and with strict the test fails listing them.  react(line, mark), if given,
    sees each line of output as it comes (on the reader's thread).
    """
    mark = f"spmd-fault-{uuid.uuid4().hex[:12]}"
    cmd = {**LAUNCHERS, **VARIANTS}[launcher](size) + [script, scenario, mark]
    proc = start(cmd, clean_env(SPMD_TIMEOUT=TIMEOUT, FAULTS_MARK=mark, **env))
    began, ready, entered, lines = time.monotonic(), [None], [None], []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if entered[0] is None and "INIT rank" in line:
                entered[0] = time.monotonic()  # a rank waits for the others from here: interpreter start is behind
            if sum("READY rank" in seen for seen in lines) == size and ready[0] is None:
                ready[0] = time.monotonic()
            if react is not None:
                react(line, mark)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=120)
        ended = time.monotonic()
    except Exception:
        os.killpg(proc.pid, signal.SIGKILL)
        reader.join(5)
        left_behind(mark)
        pytest.fail(f"{launcher} {scenario} hung for 120 s:\n{''.join(lines)[-3000:]}")
    left = left_behind(mark)
    reader.join(5)
    run = Run(code, "".join(lines), ended - (ready[0] or entered[0] or began), left)
    if strict and left:
        pytest.fail(f"{launcher} {scenario} left {len(left)} process(es) behind (killed now):\n"
                    + "\n".join(f"  {pid}: {cmd}" for pid, cmd in left.items())
                    + f"\n--- output:\n{run.out[-3000:]}")
    return run


def check(result, bound, *words, once=None):
    """Assert a failed run: non-zero exit within bound seconds, every word in its output,
    and the message once (a str or a regular expression) exactly once."""
    code, out, seconds, _ = result
    assert code != 0, out[-3000:]
    assert seconds < bound, f"took {seconds:.1f} s (bound {bound} s):\n{out[-3000:]}"
    for w in words:
        assert w in out, f"{w!r} missing from:\n{out[-3000:]}"
    heads = collections.Counter(re.findall(r"### spmd: rank \d+ .*", out))
    assert all(n == 1 for n in heads.values()), f"a rank's report twice: {heads}\n{out[-3000:]}"
    if once is not None:
        count = len(re.findall(once if isinstance(once, re.Pattern) else re.escape(once), out))
        assert count == 1, f"{once!r} {count} times, not once, in:\n{out[-3000:]}"


def play_killed(launcher, scenario, words, **kw):
    """Play a scenario where a rank is SIGKILLed; return the run that printed words.

    Under mpirun Hydra SIGKILLs the other ranks as soon as it sees one killed,
    racing spmd's hub in rank 0 (docs/reliability.md): a run where only Hydra's
    message came out must still have ended in time, and one of three runs must
    print spmd's.
    """
    result = play(launcher, scenario, **kw)
    for _ in range(2):  # a loaded machine lets Hydra win more often: one of three tries must be ours
        if launcher == "mpirun" and words not in result.out and "Killed (signal 9)" in result.out:
            check(result, CRASH)
            result = play(launcher, scenario, **kw)
    return result


needs_mpirun = pytest.mark.skipif(MPIRUN is None, reason="mpirun not found: pip install mpich")


@needs_mpirun
@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", [*LAUNCHERS, PRELOADED])
def test_a_rank_raises_before_a_collective(launcher):
    result = play(launcher, "raise")
    check(result, CRASH, "ValueError: rank 1 found a bad record", once="### spmd: rank 1 of 2")


@needs_mpirun
@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", [*LAUNCHERS, PRELOADED])
def test_a_rank_killed_inside_a_collective(launcher):
    words = "rank 1 of 3 died without reporting an error"
    check(play_killed(launcher, "sigkill", words, size=3), CRASH, once=words)


@needs_mpirun
@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_rank_that_never_starts(launcher):
    words = "MPI_Init did not complete" if launcher == "mpirun" else "only 1 of 2 ranks arrived"
    check(play(launcher, "late"), HANG, once=words)


@needs_mpirun
@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", [*LAUNCHERS, PRELOADED])
def test_ranks_calling_different_collectives_time_out_naming_the_call(launcher):
    check(play(launcher, "mismatch"), HANG, "timed out after 6 s", "(call #2)",
          once="### spmd: where the 2 ranks are")


@needs_mpirun
@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_gather_whose_peer_never_comes_times_out_in_its_description_exchange(launcher):
    # The exchange of array descriptions is the call's first wait (it hung
    # for good on mpi before it was watched).
    check(play(launcher, "stall"), HANG, once="all_gather (call #2) timed out after 6 s")


@needs_mpirun
@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_debug_mode_names_the_mismatch_on_the_spot(launcher):
    check(
        play(launcher, "mismatch", SPMD_DEBUG=1),
        CRASH,
        "rank 0: #2 broadcast root=0 float64 (1000,) at ",
        "rank 1: #2 all_reduce op=sum float64 (1000,) at ",
        "faults.py:",
        once="collective mismatch at call #2",
    )


@needs_mpirun
@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_receive_whose_sender_never_sends_times_out_naming_the_peer_and_tag(launcher):
    result = play(launcher, "deadlock")  # either rank may time out first
    check(result, HANG, "CollectiveTimeout" if launcher != "mpirun" else "### spmd: rank",
          once="timed out after 6 s waiting for its peer")
    me = re.search(r"rank (\d)(?: of \d)?: recv from rank (\d) \(tag 3\)", result[1])
    assert me and {me[1], me[2]} == {"0", "1"}, result[1][-3000:]
    if launcher != "mpirun":  # where the peer waits (mpi cannot know: docs/reliability.md)
        assert f"rank {me[2]} in #2 recv" in result[1], result[1][-3000:]


@needs_mpirun
@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_receive_into_the_wrong_shape_fails_on_both_ranks_in_debug_mode(launcher):
    result = play(launcher, "p2p-shape", SPMD_DEBUG=1)
    words = "out is a float64 array of shape (3,) but rank 0 sent float64 of shape (20000,)"
    check(result, CRASH, "(send at ", "faults.py:", "; recv at ", once=words)
    # Both ranks fail; the same error is printed in full once (docs/reliability.md, "One report per job").
    assert "### spmd: rank 0 of 2" in result[1], result[1][-3000:]
    assert "### spmd: rank 1 of 2" in result[1] or "rank 1: same error as rank 0" in result[1], result[1][-3000:]


@needs_mpirun
@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", ["mpirun", "spmd-run"])
def test_rings_of_sends_do_not_deadlock_in_debug_mode(launcher):
    code, out, *_ = play(launcher, "debug-ring", SPMD_DEBUG=1)
    assert code == 0 and out.count("RING OK rank") == 2, out[-3000:]


@needs_mpirun
@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", [*LAUNCHERS, PRELOADED])
def test_a_peer_killed_while_a_rank_waits_in_recv_ends_the_job(launcher):
    words = "rank 1 of 2 died without reporting an error"
    check(play_killed(launcher, "p2p-kill", words), CRASH, once=words)


@needs_mpirun
@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", ["mpirun", "spmd-run"])
def test_an_async_calls_wait_whose_peer_never_comes_times_out_naming_the_call(launcher):
    # wait() was outside every timeout: the mpi watcher did not see it, and on
    # gloo torch's own RuntimeError came out of it unconverted.
    result = play(launcher, "async-stall")
    words = "all_reduce (call #2) timed out after 6 s in wait() of its async handle, waiting for the other ranks"
    check(result, HANG, "### spmd: rank 0 of 2" if launcher == "mpirun" else "CollectiveTimeout: rank 0: ",
          once=words)


@needs_mpirun
@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", ["mpirun", "spmd-run"])
def test_a_debug_mismatch_in_a_script_whose_path_says_timeout_is_reported_as_the_mismatch(launcher, tmp_path):
    # The word in the path once turned the CollectiveError into "broadcast (call #2) timed out".
    script = tmp_path / "timeout_case" / "faults.py"
    script.parent.mkdir()
    script.write_text(FAULTS.read_text())
    result = play(launcher, "mismatch", script=script, SPMD_DEBUG=1)
    check(result, CRASH, "timeout_case/faults.py:", once="CollectiveError: collective mismatch at call #2")
    assert "timed out" not in result[1] and "CollectiveTimeout" not in result[1], result[1][-3000:]


@needs_mpirun
@pytest.mark.timeout(150)
def test_debug_mode_finds_all_reduce_shapes_that_differ():
    check(play("spmd-run", "shapes", SPMD_DEBUG=1), CRASH, "float64 (3,)", "float64 (4,)",
          once="collective mismatch at call #2")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("scenario", ["raise", "sigkill"])
def test_without_a_launcher_that_ends_the_job(scenario, unused_port):
    """Ranks started by hand: only spmd's own hub can end the others."""
    mark = f"spmd-fault-{uuid.uuid4().hex[:12]}"
    env = clean_env(SPMD_TIMEOUT=60, MASTER_ADDR="127.0.0.1", MASTER_PORT=unused_port, WORLD_SIZE=3)
    procs = [start([PY, FAULTS, scenario, mark], dict(env, RANK=str(r))) for r in range(3)]
    try:
        outs = [p.communicate(timeout=100)[0] for p in procs]
        seconds = since_promise("".join(outs))  # from the first rank entering init
    finally:
        left = left_behind(mark)
    assert not left, f"left behind (killed now): {left}"
    assert all(p.returncode != 0 for p in procs), outs
    assert seconds < 60, f"took {seconds:.1f} s: {outs}"  # well under the 60 s timeout
    joined = "".join(outs)
    if scenario == "raise":
        assert joined.count("ValueError: rank 1 found a bad record") == 1, joined
    else:
        assert joined.count("rank 1 of 3 died without reporting an error") == 1, joined


@pytest.fixture
def unused_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_mpirun
@pytest.mark.timeout(150)
def test_debug_mode_checks_the_equal_promise_of_gathers():
    check(play("mpirun", "equal", SPMD_DEBUG=1), CRASH, "rank 0: #2 all_gather op=equal float64 (3,)",
          "rank 1: #2 all_gather op=equal float64 (4,)", once="collective mismatch at call #2")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", ["spmd-run", PRELOADED, "torchrun"])
def test_the_first_rank_to_time_out_still_reports_where_the_others_were(launcher):
    """On gloo a timed-out rank closes its connections: the peer's 'closed by peer'
    error must not pre-empt the timeout report, which lists the peer's call."""
    check(play(launcher, "mismatch-late"), HANG, "rank 1 in #2 all_reduce (a peer closed its connection)",
          once="rank 0: broadcast (call #2) timed out after 6 s")


@needs_mpirun
@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", [*LAUNCHERS, PRELOADED])
def test_a_rank_killed_while_the_others_wait_in_a_256_mib_gather(launcher):
    words = "rank 1 of 2 died without reporting an error"
    result = play_killed(launcher, "gather-kill", words)
    check(result, CRASH, words, once=words)
    assert "GATHERED" not in result.out, result.out[-3000:]  # it died inside the gather


# What names the dead rank when it dies inside init, before its hub handshake:
# the hub never met it, so the launcher's own report is the message.
INIT_DEATH = {
    "mpirun": "EXIT STRING: Killed (signal 9)",
    "spmd-run": "spmd run: rank 1 killed by signal SIGKILL",
    PRELOADED: "spmd run: rank 1 killed by signal SIGKILL",
    "torchrun": re.compile(r"rank {6}: 1 \(local_rank: 1\)\n {2}exitcode {2}: -9 "),
}


@needs_mpirun
@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", [*LAUNCHERS, PRELOADED])
def test_a_rank_that_dies_inside_init_ends_the_job(launcher):
    # No rank gets READY: the time counts from the first rank entering init (faults.py's INIT line).
    result = play(launcher, "init-death")
    check(result, CRASH, once=INIT_DEATH[launcher])
    assert "READY" not in result.out, result.out[-3000:]


def _fuzz_then_go(go):
    """A react for play: once rank 0 names its hub, fuzz it (tests/failfast/test_hub.py's fuzz), then let the job go on."""
    from tests.failfast.test_hub import fuzz

    def react(line, mark):
        found = re.search(r"HUB (\S+) (\d+)", line)
        if found:
            fuzz((found[1], int(found[2])))
            go.touch()

    return react


@needs_mpirun
@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", [*LAUNCHERS, PRELOADED])
@pytest.mark.parametrize("ending", ["normal", "raise"])
def test_an_outsider_writing_garbage_and_fail_to_the_hub_changes_nothing(launcher, ending, tmp_path):
    go = tmp_path / "go"
    result = play(launcher, "outsider", react=_fuzz_then_go(go), FAULTS_GO=go, FAULTS_ENDING=ending)
    assert go.exists(), result.out[-3000:]
    assert result.out.count("SURVIVED rank") == 2 and "sum 3" in result.out, result.out[-3000:]
    assert "wrong secret (reported once; the job goes on)" in result.out, result.out[-3000:]
    if ending == "normal":
        assert result.code == 0 and result.out.count("DONE rank") == 2, result.out[-3000:]
        return
    check(result, CRASH, once="ValueError: rank 1 found a bad record after the fuzz")
