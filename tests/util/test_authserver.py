"""The authenticated server's thread, on real sockets on 127.0.0.1: who is served, who is closed unread, and when."""

import hmac
import socket
import time

import pytest

from spmd.util import authserver
from spmd.util.authserver import MAX_GREETING, MAX_PENDING, AuthServer, answer, bind, challenge, is_wildcard
from tests.failfast.test_hub import wait_for

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

SECRET = b"0123456789abcdef0123456789abcdef"
PREFIX = b"ECHO 1 "


class Echo(AuthServer):
    """A protocol as small as can be: answer the challenge, then every byte sent comes back."""

    def __init__(self, sock):
        super().__init__(sock, "the echo server", "test-echo")
        self.admitted, self.heard, self.forgotten, self.farewell = 0, [], 0, False
        self._start()

    def _challenge(self):
        return challenge(PREFIX)

    def _admit(self, conn, line, nonce):
        if not hmac.compare_digest(line + b"\n", answer(SECRET, nonce)):
            return "answer", "that did not answer the challenge"
        self.admitted += 1
        return None

    def _received(self, conn, data):
        if data.startswith(b"boom"):
            raise RuntimeError("boom")
        self.heard.append(data)
        conn.sendall(data)

    def _forget(self, conn):
        self.forgotten += 1

    def _farewell(self):
        self.farewell = True


@pytest.fixture
def echo():
    server = Echo(bind("127.0.0.1", 0, 128))
    yield server
    server.close()
    assert not server._thread.is_alive()


def connect(server):
    return socket.create_connection(server._server.getsockname(), timeout=10)


def nonce_of(sock):
    line = b""
    while not line.endswith(b"\n"):
        line += sock.recv(64)
    assert line.startswith(PREFIX)
    return line[len(PREFIX):-1]


def member(server, then=b""):
    """A connection that answered the challenge (and sent then right after it)."""
    sock = connect(server)
    sock.sendall(answer(SECRET, nonce_of(sock)) + then)
    return sock


def closed_within(sock, seconds):
    """Seconds until the other end closed sock (reading and discarding what comes); None if it did not."""
    began = time.monotonic()
    sock.settimeout(seconds)
    try:
        while time.monotonic() - began < seconds:
            if not sock.recv(4096):
                return time.monotonic() - began
    except (socket.timeout, TimeoutError):
        return None
    except OSError:  # reset: closed too
        return time.monotonic() - began
    return None


def test_a_right_greeting_is_admitted_and_what_follows_it_is_served(echo):
    sock = member(echo, then=b"hello")
    assert sock.recv(64) == b"hello"  # the bytes after the greeting, in the same packet
    sock.sendall(b"again")
    assert sock.recv(64) == b"again"
    assert echo.admitted == 1 and not echo._pending and len(echo._members) == 1


def test_a_silent_connection_and_half_a_greeting_are_closed_unread_after_hello_within(monkeypatch, capfd):
    monkeypatch.setattr(authserver, "HELLO_WITHIN", 0.5)
    server = Echo(bind("127.0.0.1", 0, 16))
    try:
        began = time.monotonic()
        silent, half = connect(server), connect(server)
        half.sendall(b"0123abcd")  # no newline: never a greeting
        for sock in (silent, half):
            assert closed_within(sock, 10) is not None
            assert 0.4 < time.monotonic() - began < 3.0  # both at their deadline, on a loaded machine
        assert server.admitted == 0 and not server.heard
        assert member(server, then=b"x").recv(8) == b"x"  # and the server serves on
    finally:
        server.close()
    err = capfd.readouterr().err
    assert err.count("sent no greeting within 0.5 s") == 1, err  # said once, for two


def test_a_wrong_answer_is_closed_at_once_and_what_follows_is_never_read(echo, capfd):
    for _ in range(3):
        sock = connect(echo)
        nonce_of(sock)
        sock.sendall(answer(b"f" * 32, b"guess") + b"boom and more")
        took = closed_within(sock, 10)
        assert took is not None and took < 2.0, took
    assert echo.admitted == 0 and not echo.heard
    assert capfd.readouterr().err.count("did not answer the challenge") == 1


def test_a_greeting_longer_than_max_greeting_is_closed(echo):
    sock = connect(echo)
    nonce_of(sock)
    sock.sendall(b"y" * (MAX_GREETING + 1))
    assert closed_within(sock, 10) is not None
    assert echo.admitted == 0


def test_the_pending_cap_holds_the_oldest_make_room_and_a_member_is_still_served(echo):
    held = [connect(echo) for _ in range(MAX_PENDING + 10)]
    try:
        assert wait_for(lambda: len(echo._pending) + echo.forgotten >= MAX_PENDING + 10)
        assert len(echo._pending) <= MAX_PENDING
        for sock in held[:10]:  # the oldest, closed long before their HELLO_WITHIN
            took = closed_within(sock, 2.0)
            assert took is not None, "an old stranger was not evicted"
        for sock in held[-5:]:  # the newest still wait
            nonce_of(sock)
            assert closed_within(sock, 0.1) is None
        assert member(echo, then=b"in").recv(8) == b"in"
    finally:
        for sock in held:
            sock.close()


def test_a_failure_serving_one_member_closes_that_one_only(echo, capfd):
    bad, good = member(echo), member(echo)
    bad.sendall(b"boom")
    assert closed_within(bad, 5) is not None
    good.sendall(b"ok")
    assert good.recv(8) == b"ok"
    assert echo._thread.is_alive()
    assert "the echo server dropped a connection after RuntimeError('boom')" in capfd.readouterr().err


def test_close_says_farewell_and_closes_members_and_strangers(echo):
    sock, stranger = member(echo, then=b"x"), connect(echo)
    assert sock.recv(8) == b"x"
    echo.close()
    assert not echo._thread.is_alive() and echo.farewell
    assert closed_within(sock, 2) is not None and closed_within(stranger, 2) is not None
    with pytest.raises(OSError):
        connect(echo)


def test_it_binds_one_interface_and_the_answer_is_the_hmac_of_the_nonce():
    sock = bind("127.0.0.1", 0, 1)
    try:
        assert sock.getsockname()[0] == "127.0.0.1" and not is_wildcard("127.0.0.1")
    finally:
        sock.close()
    assert is_wildcard("0.0.0.0") and is_wildcard("::") and is_wildcard("")
    line, nonce = challenge(PREFIX)
    assert line == PREFIX + nonce + b"\n" and len(nonce) == 32 and challenge(PREFIX)[1] != nonce
    assert answer(SECRET, nonce) != answer(b"x" * 32, nonce) and answer(SECRET, nonce).endswith(b"\n")
