"""``mpirun -n 4 python -m spmd.repl``: the REPL on a world MPICH's mpirun started, driven through a terminal."""

import os
import re
import time
import uuid

import pexpect
import pytest

from tests.support import MPIRUN, PY, clean_env, left_behind, missing

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(240)]

PROMPT = r"\r\n>>> "


def _spawn(mark, timeout=None):
    if MPIRUN is None:
        missing("mpirun (the mpich wheel) is needed: bin/setup installs it")
    extra = {"SPMD_REPL_TIMEOUT": timeout} if timeout else {}
    env = clean_env(SPMD_REPL_MARK=mark, SPMD_REPL_HISTORY=os.devnull, TERM="dumb", **extra)
    return pexpect.spawn(MPIRUN, ["-n", "4", PY, "-m", "spmd.repl"], env=env, encoding="utf-8", timeout=90,
                         dimensions=(50, 200))


def _say(child, line):
    child.sendline(line)
    child.expect(PROMPT)
    return [ln for ln in child.before.replace("\r", "").split("\n")[1:] if ln]


def test_blocks_commands_a_timeout_and_a_ctrl_c_under_mpirun():
    mark = uuid.uuid4().hex
    child = _spawn(mark, timeout=3)
    child.expect(r"spmd repl: 4 launched ranks")
    child.expect(">>> ")
    assert _say(child, "import numpy as np, time") == []
    assert _say(child, "print(comm.rank % 2)") == ["[0,2] 0", "[1,3] 1"]
    assert _say(child, "comm.all_reduce(np.ones(1) * comm.rank)") == ["[0-3] array([6.])"]
    assert _say(child, "%on 3 comm.size") == ["[3] 4"]
    assert _say(child, "%push k=5") == []
    assert _say(child, "r = k * comm.rank") == []
    assert _say(child, "%pull r") == ["[0, 5, 10, 15]"]
    out = _say(child, "1 / (comm.rank - 2)")
    assert "[2] ZeroDivisionError: division by zero" in out and "[3] 1.0" in out
    child.sendline("while comm.rank == 1: time.sleep(0.01)")
    child.expect(r"\.\.\. ")
    out = _say(child, "")
    assert "[1] KeyboardInterrupt" in out
    assert "spmd: the block did not finish within its timeout of 3 s; where the ranks are:" in out
    assert "  ranks 0,2-3: finished" in out
    assert _say(child, "%pull r") == ["[0, 5, 10, 15]"]  # the world and the namespace are kept
    assert _say(child, "%timeout off") == ["spmd: no timeout"]
    child.sendline("time.sleep(60)")
    time.sleep(2.0)
    child.sendintr()  # the terminal's Ctrl-C: mpirun passes it to every rank
    child.expect(PROMPT)
    said = child.before.replace("\r", "")
    assert "[0-3] KeyboardInterrupt" in said and re.search(r"spmd: rank \d got SIGINT after [0-9.]+ s", said)
    assert _say(child, "comm.all_reduce(np.ones(1))") == ["[0-3] array([4.])"]
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert left_behind(mark, grace=5.0) == {}


def test_ranks_stuck_in_a_collective_end_the_session_and_the_job_saying_why():
    mark = uuid.uuid4().hex
    child = _spawn(mark, timeout=2)
    child.expect(">>> ")
    assert _say(child, "%restart") == ["spmd: a launcher's ranks cannot be started afresh: leave and launch again"]
    child.sendline("comm.barrier() if comm.rank else None")
    child.expect(pexpect.EOF)
    said = child.before.replace("\r", "")
    assert "spmd: the block did not finish within its timeout of 2 s; where the ranks are:" in said
    assert re.search(r"ranks 1-3: waiting in barrier #\d+ at <spmd-1>:1", said), said
    assert "a launcher's ranks cannot be started afresh here, so this world ends" in said
    child.close()
    assert child.exitstatus != 0
    assert left_behind(mark, grace=5.0) == {}


def test_a_rank_that_dies_under_mpirun_ends_the_job():
    mark = uuid.uuid4().hex
    child = _spawn(mark)
    child.expect(">>> ")
    child.sendline("import os; os._exit(3) if comm.rank == 2 else comm.barrier()")
    child.expect(pexpect.EOF)
    # MPICH's mpirun ends the job as soon as a rank exits with an error: the prompt's note, or spmd's
    # fail-fast line naming rank 2, may come after mpirun has returned, so neither is asserted here.
    child.close()
    assert child.exitstatus != 0
    assert left_behind(mark, grace=5.0) == {}
