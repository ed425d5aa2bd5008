"""The hub's heartbeat: a side that hears nothing for MISSES beats ends the job, naming the silent host.

Rank 0's hub runs in this process with an exit_now that records instead of exiting (the ``exits``
fixture); other ranks are real HubClients, or sockets that greet and then say nothing, as a frozen
host or one behind a cut link does.  Beats are 0.1-0.2 s apart here, to keep the tests short.
"""

import socket
import time

import numpy as np
import pytest

from spmd.failfast.hub import PEER_EXIT, open_hub
from spmd.failfast.hub.judge import MISSES

pytestmark = pytest.mark.unit


def _hub(beat, size=3):
    shared = []
    hub = open_hub(0, size, lambda v: shared.append(v) or v, True, 5, name="h1", beat=beat)
    hub.invitation = shared[0]
    return hub


def _greet(hub, rank, host):
    """A rank that greets as a rank on host does, then never says a word."""
    sock = socket.create_connection(hub.address, timeout=5)
    sock.sendall(f"HELLO {rank} {hub.invitation.split(' ')[1]} {host}\n".encode())
    return sock


def test_a_rank_that_goes_silent_is_named_with_its_host_after_misses_beats(exits):
    hub = _hub(0.2)
    try:
        live = open_hub(2, 3, lambda _: hub.invitation, True, 5, name="h3", beat=0.2)
        mute = _greet(hub, 1, "h2")
        began = time.monotonic()
        code, message = exits.get(timeout=10)
        took = time.monotonic() - began
        assert code == PEER_EXIT and message.startswith("### spmd: no word from h2 (rank 1) for 1 s"), message
        assert "h3" not in message and message.endswith("; ending the job")
        assert 0.2 * MISSES - 0.1 < took < 0.2 * MISSES + 2.0, took  # the bound, with room for a loaded machine
        mute.settimeout(5)
        heard = b""
        while b"ABORT\n" not in heard:
            heard += mute.recv(4096)
        assert heard.count(b"BEAT\n") >= MISSES - 1, heard  # beats went out to it meanwhile, then the ABORT
        live._closing = True  # its ABORT is recorded, not obeyed, here
        live.close()
    finally:
        hub.close()


def test_ranks_that_beat_keep_the_job_alive_through_a_busy_main_thread(exits):
    """Every side beats every 0.1 s (silence after 0.5 s) while this process's main thread, which all
    of them share, runs a pure-Python loop and numpy's for 1.5 s each: no side is starved into silence."""
    hub = _hub(0.1)
    ranks = [open_hub(r, 3, lambda _: hub.invitation, True, 5, name=f"h{r + 1}", beat=0.1) for r in (1, 2)]
    try:
        end = time.monotonic() + 1.5
        total = 0
        while time.monotonic() < end:  # the interpreter switches threads every 5 ms
            total += sum(i * i for i in range(1000))
        a = np.random.default_rng(0).random((256, 256))
        end = time.monotonic() + 1.5
        while time.monotonic() < end:  # small numpy calls, each holding the GIL briefly
            a = np.tanh(a @ a.T / 256.0)
        assert total > 0 and exits.empty(), exits.get()
    finally:
        for rank in ranks:
            rank.close()
        hub.close()
    time.sleep(0.3)
    assert exits.empty()


def test_a_rank_ends_itself_naming_rank_0s_host_when_rank_0_goes_silent(exits):
    """A hub that greets nobody back and never beats (rank 0 frozen, or behind a cut link): the rank sends
    its own beats, then ends with a message naming rank 0's host."""
    server = socket.create_server(("127.0.0.1", 0))
    try:
        port = server.getsockname()[1]
        rank = open_hub(1, 2, lambda _: f"127.0.0.1:{port} {'s' * 32} h1", True, 5, name="h2", beat=0.2)
        conn, _ = server.accept()
        began = time.monotonic()
        code, message = exits.get(timeout=10)
        took = time.monotonic() - began
        assert code == PEER_EXIT, message
        assert message.startswith("### spmd: rank 1: no word from h1 (rank 0) for 1 s (no heartbeat"), message
        assert 0.2 * MISSES - 0.1 < took < 0.2 * MISSES + 2.0, took
        conn.settimeout(5)
        said = conn.recv(4096)
        assert said.startswith(b"HELLO 1 " + b"s" * 32 + b" h2\n") and b"BEAT\n" in said, said
        rank._closing = True
        conn.close()
    finally:
        server.close()


def test_no_heartbeat_when_turned_off(exits):
    hub = _hub(0.0)
    try:
        mute = _greet(hub, 1, "h2")
        time.sleep(1.0)
        assert exits.empty()
        mute.settimeout(0.2)
        with pytest.raises(socket.timeout):
            mute.recv(64)  # and nothing was sent
    finally:
        hub.close()


def test_rank_0_says_why_it_ends_the_job_before_any_rank_hears_abort(monkeypatch):
    """A launcher that ends every rank when the first exits (Hydra) cuts off what is still in a pipe: rank 0's
    words must be written (and flushed) before the ABORT that ends the others goes out."""
    from spmd.failfast.hub import base

    said = []

    def exit_now(code, message=None, before=None):
        mute.settimeout(0.3)
        try:
            heard = mute.recv(65536)
        except socket.timeout:
            heard = b""
        said.append((code, message, heard))  # what the silent rank had heard when the words were out
        before()

    monkeypatch.setattr(base, "exit_now", exit_now)
    hub = _hub(0.2, size=2)
    try:
        mute = _greet(hub, 1, "h2")
        deadline = time.monotonic() + 10
        while not said and time.monotonic() < deadline:
            time.sleep(0.05)
        code, message, heard = said[0]
        assert code == PEER_EXIT and message.startswith("### spmd: no word from h2 (rank 1)"), message
        assert b"ABORT" not in heard, heard  # beats only, so far
        mute.settimeout(5)
        while b"ABORT\n" not in heard:
            heard += mute.recv(4096)
    finally:
        hub.close()
