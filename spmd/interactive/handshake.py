"""How a rank's engine, or a launched session's host, proves to whom it connects that it belongs.

The listener sends a challenge line (spmd.util.authserver's, with the
job store's GREETING); the connecting side answers with the HMAC of its nonce
under the session's secret, then says which rank it is (-1: the host, to
a notebook's front end).  Anyone else is closed unread.
"""

from __future__ import annotations

import hmac
import socket

from spmd.runtime.jobstore.frames import GREETING
from spmd.util.authserver import answer, challenge
from spmd.util import pickled

__all__ = ["admit", "connect", "WITHIN", "FRONT", "FRONT_SECRET"]

#: Seconds a connection has to answer.
WITHIN = 60.0
#: Where a front end that launched a world (spmd.interactive.mpi) waits for rank 0's host (host:port) ...
FRONT = "SPMD_REPL_FRONT"
#: ... and the secret, in hex, that the host proves it knows.
FRONT_SECRET = "SPMD_REPL_FRONT_SECRET"


def admit(conn: socket.socket, secret: bytes) -> int | None:
    """The rank a connection says it is, once it answered the challenge; None for anyone else."""
    greeting, nonce = challenge(GREETING)
    try:
        conn.settimeout(5.0)
        conn.sendall(greeting)
        line = b""
        while not line.endswith(b"\n") and len(line) < 200:
            chunk = conn.recv(1)  # a byte at a time: the first frame follows the line
            if not chunk:
                return None
            line += chunk
        if not hmac.compare_digest(line, answer(secret, nonce)):
            return None
        conn.settimeout(None)
        said = pickled.recv(conn)
    except OSError:
        return None
    rank = said.get("rank") if isinstance(said, dict) else None
    return rank if isinstance(rank, int) else None


def connect(address: tuple[str, int], secret: bytes, rank: int) -> socket.socket:
    """Connect to address, answer its challenge and say rank."""
    sock = socket.create_connection(address, timeout=WITHIN)
    greeting = b""
    while not greeting.endswith(b"\n") and len(greeting) < 200:
        chunk = sock.recv(200)
        if not chunk:
            break
        greeting += chunk
    if not greeting.startswith(GREETING):
        raise ConnectionError(f"{address[0]}:{address[1]} is not this session's")
    sock.sendall(answer(secret, greeting[len(GREETING):].strip()))
    sock.settimeout(None)
    pickled.send(sock, {"rank": rank})
    return sock
