"""Messages between spmd's own processes: one pickled object per length-prefixed frame.

The pytest plugin's processes and an interactive session's use it, over
socketpairs they inherit, or over connections that first proved they
know the session's secret (spmd.interactive.handshake): unpickling
trusts its peer, so nothing else may send here.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

__all__ = ["send", "recv", "pair"]

_HEADER = struct.Struct("!Q")


def pair() -> tuple[socket.socket, socket.socket]:
    """Return a connected pair of stream sockets, inheritable by a child."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.set_inheritable(True)
    b.set_inheritable(True)
    return a, b


def send(sock: socket.socket, obj: Any) -> None:
    """Send one object (raises OSError when the peer has gone)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        try:
            chunk = sock.recv(min(n - got, 1 << 20))
        except (ConnectionResetError, InterruptedError):
            return None
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket) -> Any:
    """Receive one object; None when the peer has closed its end (or died)."""
    head = _exactly(sock, _HEADER.size)
    if head is None:
        return None
    data = _exactly(sock, _HEADER.unpack(head)[0])
    return None if data is None else pickle.loads(data)
