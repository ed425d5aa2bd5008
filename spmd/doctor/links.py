"""One host's end of the doctor's links: a listener for the job's members only, bytes timed, clocks read.

``LinkServer`` listens on the address the host would use for the job (never a wildcard) and opens
each connection with a challenge (``SPMD-DOCTOR 1 <nonce>``, answered with the HMAC of the nonce under
the doctor's secret, as the job store does); a connection that does not answer within ANSWER_WITHIN
seconds, or asks for anything else, is closed unread.  A member then asks for one of two things:
``t``, this host's clock (for ``clock_offset``), or ``b``, to be sent bytes until the sender stops,
answered with how many came in how long (``send_for``).  ``pairings`` plans the rounds of a matrix so
that each host sends to one host and hears from one at a time.  docs/doctor.md.
"""

from __future__ import annotations

import secrets
import select
import socket
import struct
import threading
import time

from spmd.runtime.jobstore.frames import recv_exactly
from spmd.util.authserver import answer

__all__ = ["LinkServer", "send_for", "clock_offset", "pairings", "ANSWER_WITHIN", "GREETING"]

GREETING = b"SPMD-DOCTOR 1 "
#: Seconds a new connection has to answer the challenge, and a reply may take.
ANSWER_WITHIN = 3.0
#: Connections served at once, at most; more are closed unread.
MAX_SERVED = 32
_TIME = struct.Struct("!d")
_RECEIVED = struct.Struct("!Qd")
_CHUNK = 256 * 1024


class LinkServer:
    """Serve the doctor's requests on address (port 0: any free one) to holders of secret."""

    def __init__(self, address: str, secret: bytes) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._sock = socket.create_server((address, 0), family=family, backlog=64)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._secret = secret
        self._slots = threading.BoundedSemaphore(MAX_SERVED)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="spmd-doctor-links", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._done.set()
        self._thread.join(2)
        self._sock.close()

    def _accept(self) -> None:
        while not self._done.is_set():
            try:
                conn, _ = self._sock.accept()
            except (socket.timeout, OSError):
                continue
            if not self._slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(ANSWER_WITHIN)
            nonce = secrets.token_hex(16).encode()
            conn.sendall(GREETING + nonce + b"\n")
            expected = answer(self._secret, nonce)
            if recv_exactly(conn, len(expected)) != expected:
                return
            kind = recv_exactly(conn, 1)
            if kind == b"t":
                while recv_exactly(conn, 1) == b"?":
                    conn.sendall(_TIME.pack(time.time()))
            elif kind == b"b":
                conn.sendall(_RECEIVED.pack(*_count(conn)))
        except (OSError, ConnectionError, ValueError):
            pass
        finally:
            conn.close()
            self._slots.release()


def _count(conn: socket.socket) -> tuple[int, float]:
    """Read until the sender stops; return (bytes, seconds from the first byte to the end)."""
    buf = bytearray(_CHUNK)
    total, started = 0, None
    while True:
        n = conn.recv_into(buf)
        if not n:
            break
        if started is None:
            started = time.monotonic()
        total += n
    return total, (time.monotonic() - started) if started is not None else 0.0


def _open(address: str, port: int, secret: bytes, kind: bytes, seconds: float) -> socket.socket:
    """A connection to a LinkServer, past its challenge, that has asked for kind."""
    sock = socket.create_connection((address, port), timeout=seconds)
    try:
        sock.settimeout(ANSWER_WITHIN)
        line = bytearray()
        while not line.endswith(b"\n") and len(line) < 128:
            line += recv_exactly(sock, 1)
        if not line.startswith(GREETING):
            raise ConnectionError(f"{address}:{port} is not a doctor's link (it said {bytes(line[:40])!r})")
        sock.sendall(answer(secret, bytes(line[len(GREETING):-1])) + kind)
        return sock
    except BaseException:
        sock.close()
        raise


def send_for(address: str, port: int, secret: bytes, seconds: float, max_bytes: int) -> tuple[float | None, str | None]:
    """Send bytes to a LinkServer for seconds or max_bytes, whichever comes first; return (MB/s the
    receiver counted, None) or (None, why not)."""
    try:
        sock = _open(address, port, secret, b"b", ANSWER_WITHIN)
    except (OSError, ConnectionError) as exc:
        return None, f"could not open a link to {address}:{port}: {exc}"
    with sock:
        # a small send buffer: what is queued when the clock stops drains within a moment, even capped
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _CHUNK)
        chunk = memoryview(bytes(_CHUNK))
        sent, deadline = 0, time.monotonic() + seconds
        try:
            while sent < max_bytes and time.monotonic() < deadline:
                _, ready, _ = select.select([], [sock], [], max(0.0, deadline - time.monotonic()))
                if ready:
                    sent += sock.send(chunk[: min(_CHUNK, max_bytes - sent)])
            sock.shutdown(socket.SHUT_WR)
            received, took = _RECEIVED.unpack(recv_exactly(sock, _RECEIVED.size))
        except (OSError, ConnectionError) as exc:
            return None, f"the link to {address}:{port} broke after {sent} bytes: {exc}"
    if received < sent or took <= 0:
        return None, f"{address}:{port} counted {received} of {sent} bytes"
    return received / took / 1e6, None


def clock_offset(address: str, port: int, secret: bytes, samples: int = 5) -> float | None:
    """Seconds this host's clock is ahead of the LinkServer's host's (of the sample that took the least
    time there and back), or None when it could not be read."""
    try:
        with _open(address, port, secret, b"t", ANSWER_WITHIN) as sock:
            best = None
            for _ in range(samples):
                before = time.time()
                sock.sendall(b"?")
                (theirs,) = _TIME.unpack(recv_exactly(sock, _TIME.size))
                after = time.time()
                if best is None or after - before < best[0]:
                    best = (after - before, (before + after) / 2 - theirs)
            return best[1] if best else None
    except (OSError, ConnectionError):
        return None


def pairings(hosts: list[int]) -> list[list[tuple[int, int]]]:
    """Rounds in which every pair of hosts meets once and each host meets one other (the circle method)."""
    order = list(hosts) + ([None] if len(hosts) % 2 else [])
    rounds = []
    for _ in range(len(order) - 1):
        half = len(order) // 2
        rounds.append([(a, b) for a, b in zip(order[:half], reversed(order[half:])) if a is not None and b is not None])
        order = [order[0], order[-1]] + order[1:-1]
    return [r for r in rounds if r]
