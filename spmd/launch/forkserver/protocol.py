"""The wire format between a launcher and its fork server: one JSON message per packet.

An ``AF_UNIX`` ``SOCK_SEQPACKET`` socket carries one message per write, file
descriptors riding along with ``SCM_RIGHTS``; the messages of each side are
listed in docs/preload.md ("The protocol").  Only the standard library.
"""

from __future__ import annotations

import json
import os
import select
import socket
from typing import Any, Iterable

from spmd.errors import LaunchError

__all__ = ["send", "recv", "tell", "hung_up", "MAX_MESSAGE"]

#: Bytes of one message, at most (a rank's request carries only what differs from the server's environment).
MAX_MESSAGE = 1 << 20


def send(sock: socket.socket, message: dict[str, Any], fds: Iterable[int] = ()) -> None:
    """Send one JSON message, with fds attached."""
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """Receive one message and its fds; (None, []) at the end of the stream (or a peer that left abruptly)."""
    try:
        data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, 8)
    except ConnectionResetError:  # the peer closed with our messages unread
        return None, []
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        raise LaunchError("spmd run --preload: a message between the launcher and its fork server was cut")
    if not data:
        return None, fds
    return json.loads(data), fds


def tell(sock: socket.socket, message: dict[str, Any]) -> None:
    """Send message unless the peer is gone (then a server has no one to tell)."""
    try:
        send(sock, message)
    except OSError:
        pass


def hung_up(sock: socket.socket, timeout: float) -> bool:
    """Wait up to timeout seconds for sock's peer to close its end; tell whether it has.

    An AF_UNIX socket reports POLLHUP only once the peer has closed it, not
    when the peer has only shut down its writing side.
    """
    poller = select.poll()
    poller.register(sock, 0)  # POLLHUP and POLLERR come whatever is asked for
    return bool(poller.poll(timeout * 1000))
