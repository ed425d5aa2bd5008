"""A user's tests that go wrong on one rank: each fails alone, and the next test runs on healthy ranks."""

import ctypes
import os
import signal
import time

import numpy as np
import pytest


@pytest.mark.spmd(ranks=3, timeout=3)
def test_deadlock(comm):
    if comm.rank != 1:
        comm.all_reduce(np.ones(1))
    else:
        comm.recv(src=0)


@pytest.mark.spmd(ranks=2)
def test_healthy_after_deadlock(comm):
    assert comm.all_reduce(np.ones(1))[0] == 2


@pytest.mark.spmd(ranks=3)
def test_segfault(comm):
    comm.barrier()
    if comm.rank == 2:
        ctypes.string_at(0)
    comm.barrier()


@pytest.mark.spmd(ranks=3)
def test_exit_status(comm):
    if comm.rank == 1:
        os._exit(3)
    comm.all_reduce(np.ones(1))


@pytest.mark.spmd(ranks=3)
def test_sigkill(comm):
    if comm.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    comm.all_reduce(np.ones(1))


@pytest.mark.spmd(ranks=3, timeout=60)
def test_raise_while_the_others_wait(comm):
    if comm.rank == 2:
        raise ValueError("boom on rank 2")
    comm.all_reduce(np.ones(1))


@pytest.mark.spmd(ranks=2, timeout=3)
def test_python_loop_past_the_timeout(comm):
    comm.barrier()
    while comm.rank == 1:
        time.sleep(0.01)


@pytest.mark.spmd(ranks=2)
def test_leaves_a_message_and_a_file(comm, tmp_path):
    (tmp_path / "left.txt").write_text("from the test before")
    if comm.rank == 0:
        comm.send(np.full(4, 7.0), dst=1, tag=5)  # never received


@pytest.mark.spmd(ranks=2)
def test_sees_neither(comm, tmp_path):
    assert list(tmp_path.iterdir()) == []
    if comm.rank == 0:
        comm.send(np.full(4, 1.0), dst=1, tag=5)
    else:
        assert comm.recv(src=0, tag=5).tolist() == [1.0] * 4
