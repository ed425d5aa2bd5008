"""A Session of 3 real ranks on gloo: merged output, values in and out, timeouts, interrupts, deaths, restarts.

One session serves the module's tests in order (each leaves the world usable
for the next, or says how it is rebuilt); the last one stops it and checks
that no process is left.
"""

import re
import threading
from pathlib import Path

import pytest

from spmd.errors import SessionError
from spmd.interactive.merge import render
from spmd.interactive.session import Session

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def s():
    session = Session(3, timeout=20)
    yield session
    session.stop()


def lines(reply):
    return render(reply).rstrip("\n").split("\n")


def test_a_block_runs_on_every_rank_its_output_and_value_merged(s):
    reply = s.run("import numpy as np\nx = comm.rank\nprint('rank', x)\nprint('same')\ncomm.all_reduce(np.ones(2))")
    assert lines(reply) == ["[0] rank 0", "[1] rank 1", "[2] rank 2", "[0-2] same", "[0-2] array([3., 3.])"]
    assert lines(s.run("x * 10")) == ["[0] 0", "[1] 10", "[2] 20"]


def test_an_exception_is_shown_once_per_distinct_traceback_and_the_session_goes_on(s):
    out = lines(s.run("1 / (comm.rank - 1) if comm.rank else 1 / 0"))
    assert out.count("[0,2] Traceback (most recent call last):") == 0  # the ranks raise differently
    assert "[0] ZeroDivisionError: division by zero" in out and "[1] ZeroDivisionError: division by zero" in out
    assert "[2] 1.0" in out
    assert lines(s.run("x")) == ["[0] 0", "[1] 1", "[2] 2"]


def test_pull_push_and_a_block_on_some_ranks(s):
    assert s.pull("x") == [0, 1, 2]
    s.push({"y": {"a": [1, 2]}})
    assert lines(s.run("y['a'][0] + comm.rank")) == ["[0] 1", "[1] 2", "[2] 3"]
    s.push({"z": 5}, ranks=[1])
    assert lines(s.run("z", ranks=[1])) == ["[1] 5"]
    with pytest.raises(SessionError, match=r"cannot pull 'z' from rank\(s\) 0,2: NameError"):
        s.pull("z")
    with pytest.raises(SessionError, match="between 0 and 2"):
        s.run("1", ranks=[3])


def test_a_block_past_its_timeout_reports_where_every_rank_is_and_the_world_stays_usable(s):
    out = lines(s.run("import time\nwhile comm.rank == 1:\n    time.sleep(0.01)", timeout=2))
    assert "[1] KeyboardInterrupt" in out
    assert "spmd: the block did not finish within its timeout of 2 s; where the ranks are:" in out
    assert any(re.fullmatch(r"  rank 1: at <spmd-\d+>:3 in <module>\(\)", line) for line in out), out
    assert "  ranks 0,2: finished" in out
    assert lines(s.run("comm.all_reduce(np.ones(1))")) == ["[0-2] array([3.])"]
    assert s.pull("x") == [0, 1, 2]  # the namespace is kept


def test_an_interrupt_reaches_every_rank_even_in_a_sleep_and_the_namespace_stays(s):
    threading.Timer(1.0, s.interrupt).start()
    out = lines(s.run("time.sleep(60)"))
    assert "[0-2] KeyboardInterrupt" in out and any(n.startswith("spmd: interrupted after") for n in out)
    assert s.pull("x") == [0, 1, 2]


def test_ranks_blocked_in_a_collective_are_started_afresh_and_it_is_said_plainly(s):
    s.run("import os\npid = os.getpid()")
    before = s.pull("pid")
    threading.Timer(1.0, s.interrupt).start()
    out = lines(s.run("comm.barrier() if comm.rank != 2 else None"))
    note = [n for n in out if "did not stop" in n]
    assert note and note[0].startswith("spmd: ranks 0-1 did not stop within 2 s of the interrupt (inside barrier #")
    assert "the world was started afresh on 3 ranks" in note[0] and "every rank's variables are gone" in note[0]
    assert "[0-2] NameError: name 'x' is not defined" in lines(s.run("x"))
    s.run("import os, numpy as np\npid = os.getpid()")
    assert set(s.pull("pid")).isdisjoint(before)
    assert lines(s.run("comm.all_reduce(np.ones(1))")) == ["[0-2] array([3.])"]


def test_a_rank_that_dies_is_reported_and_restart_brings_the_world_back(s):
    out = lines(s.run("import signal\nif comm.rank == 2:\n    os.kill(os.getpid(), signal.SIGKILL)\ncomm.barrier()"))
    assert out[-1] == ("spmd: the world has ended: rank 2 killed by signal SIGKILL; %restart starts 3 "
                       "fresh ranks")
    assert lines(s.run("1")) == ["spmd: the world has ended: rank 2 killed by signal SIGKILL; restart the "
                                 "world first (%restart)"]
    assert s.restart() > 0
    assert lines(s.run("comm.all_reduce(__import__('numpy').ones(1))")) == ["[0-2] array([3.])"]


def test_stop_leaves_no_process(s):
    s.run("import os\npid = os.getpid()")
    pids = [*s.pull("pid"), s._proc.pid]
    s.stop()
    assert [p for p in pids if Path(f"/proc/{p}").exists()] == []
    with pytest.raises(SessionError, match="stopped"):
        s.run("1")


@pytest.mark.timeout(60)
def test_bad_arguments_are_refused_before_anything_starts():
    with pytest.raises(SessionError, match="number of ranks >= 1"):
        Session(0)
    with pytest.raises(SessionError, match="gloo or mpi"):
        Session(2, backend="nccl")
    with pytest.raises(SessionError, match="seconds > 0"):
        Session(2, timeout=-1)
    with pytest.raises(SessionError, match="--preload no_such_module_xyz: cannot import it"):
        Session(1, preload=["no_such_module_xyz"])
