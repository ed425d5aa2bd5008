"""One rank of a session: an interrupt that comes before its block begins still stops that block, and no other."""

import signal
import socket
import threading
import time

import pytest

from spmd.comms.backends.serial import SerialBackend
from spmd.comms.comm import Comm
from spmd.interactive.engine import Engine
from spmd.util import pickled

pytestmark = pytest.mark.unit


def _until(check, what, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        time.sleep(0.005)


@pytest.fixture
def engine():
    host, rank = socket.socketpair()
    saved = signal.getsignal(signal.SIGINT)
    try:
        yield Engine(Comm(SerialBackend()), rank), host
    finally:
        signal.signal(signal.SIGINT, saved)
        host.close()


def test_an_interrupt_before_its_block_begins_stops_that_block_as_it_starts(engine):
    eng, host = engine
    pickled.send(host, {"op": "run", "code": "x = 1", "id": 1})
    _until(lambda: eng._sent == 1, "the block queued")
    pickled.send(host, "interrupt")  # a Ctrl-C right after Enter: the rank has not begun the block
    _until(lambda: eng._cancel == 1, "the interrupt noted")
    pickled.send(host, {"op": "run", "code": "y = 2", "id": 2})
    pickled.send(host, {"op": "leave"})
    eng.serve()  # the rank's main thread begins the blocks only now
    first, second = pickled.recv(host), pickled.recv(host)
    assert first["kind"] == "KeyboardInterrupt" and "x" not in eng.ns, first
    assert second["error"] is None and eng.ns["y"] == 2, second  # the next block is not touched


def test_an_interrupt_after_a_block_replied_stops_nothing_later(engine):
    eng, host = engine

    def host_side():
        _until(lambda: eng._replied == 1, "block 1 replied")
        pickled.send(host, "interrupt")  # late: block 1 had ended
        _until(lambda: eng._asked, "the interrupt heard")
        pickled.send(host, {"op": "run", "code": "y = 2", "id": 2})
        pickled.send(host, {"op": "leave"})

    pickled.send(host, {"op": "run", "code": "x = 1", "id": 1})
    helper = threading.Thread(target=host_side, daemon=True)
    helper.start()
    eng.serve()
    helper.join(10)
    first, second = pickled.recv(host), pickled.recv(host)
    assert first["error"] is None and second["error"] is None, (first, second)
    assert eng.ns["x"] == 1 and eng.ns["y"] == 2
