"""Rank 0's side of the job store: the job's keys, and the thread that serves members' requests.

A connection is served only after it answered the challenge with the
job's secret (the accepting, the deadline and the cap on strangers are
``spmd.util.authserver``'s); anything else is closed unread, and no input
ends the thread.  A request for a key not yet set (get, wait, multi_get)
is answered when the key is set: the client bounds the wait.
"""

from __future__ import annotations

import hmac
import socket
from typing import cast

from spmd.runtime.jobstore import frames
from spmd.util.authserver import AuthServer, answer, bind, challenge

__all__ = ["StoreServer", "bind"]

_WAITS = {frames.OPS["get"], frames.OPS["wait"], frames.OPS["multi_get"]}


class _Conn:
    """A member's connection: its frames not yet whole, and its unsent bytes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.frames = frames.Frames()
        self.out = bytearray()


class StoreServer(AuthServer):
    """Serve the job's keys on sock (bound, listening) to connections that know secret."""

    def __init__(self, sock: socket.socket, secret: bytes) -> None:
        super().__init__(sock, "the job store", "spmd-store")
        self._secret = secret
        self.address = sock.getsockname()[:2]
        self._data: dict[bytes, bytes] = {}
        self._conns: dict[socket.socket, _Conn] = {}  # the members'
        self._waiting: list[tuple[_Conn, int, list[bytes]]] = []
        self._start()

    # -- what the store's protocol adds to AuthServer -----------------------------------

    def _challenge(self) -> tuple[bytes, object]:
        return challenge(frames.GREETING)

    def _admit(self, sock: socket.socket, line: bytes, token: object) -> tuple[str, str] | None:
        if not hmac.compare_digest(line + b"\n", answer(self._secret, cast(bytes, token))):
            return "answer", "that did not prove it belongs to the job"
        self._conns[sock] = _Conn(sock)
        return None

    def _received(self, sock: socket.socket, data: bytes) -> None:
        conn = self._conns[sock]
        try:
            got = conn.frames.feed(data)
        except OverflowError as exc:
            self._note("frame", f"the job store closed a member's connection after {exc}")
            self._drop(sock)
            return
        for code, fields in got:
            self._request(conn, code, fields)

    def _writable(self, sock: socket.socket) -> None:
        self._flush(self._conns[sock])

    def _forget(self, sock: socket.socket) -> None:
        conn = self._conns.pop(sock, None)
        if conn is not None:
            self._waiting = [w for w in self._waiting if w[0] is not conn]

    # -- requests ------------------------------------------------------------------

    def _request(self, conn: _Conn, code: int, fields: list[bytes]) -> None:
        reply = self._answer(code, fields)
        if reply is None:
            self._waiting.append((conn, code, fields))
            return
        self._send(conn, reply)
        if code not in _WAITS and self._waiting:
            self._retry()

    def _retry(self) -> None:
        waiting, self._waiting = self._waiting, []
        for conn, code, fields in waiting:
            reply = self._answer(code, fields)
            if reply is None:
                self._waiting.append((conn, code, fields))
            else:
                self._send(conn, reply)

    def _answer(self, code: int, f: list[bytes]) -> bytes | None:  # noqa: C901 - one branch per operation
        data, ops = self._data, frames.OPS
        try:
            if code == ops["set"]:
                data[f[0]] = f[1]
            elif code == ops["get"]:
                return frames.frame(frames.OK, data[f[0]]) if f[0] in data else None
            elif code == ops["add"]:
                value = int(data.get(f[0], b"0")) + int(f[1])
                data[f[0]] = str(value).encode()
                return frames.frame(frames.OK, data[f[0]])
            elif code == ops["compare_set"]:
                key, expected, desired = f
                if (key not in data and expected == b"") or data.get(key) == expected:
                    data[key] = desired
                return frames.frame(frames.OK, data.get(key, expected))
            elif code == ops["check"]:
                return frames.frame(frames.OK, b"1" if all(k in data for k in f) else b"0")
            elif code in (ops["wait"], ops["multi_get"]):
                if not all(k in data for k in f):
                    return None
                return frames.frame(frames.OK, *([data[k] for k in f] if code == ops["multi_get"] else []))
            elif code == ops["delete_key"]:
                return frames.frame(frames.OK, b"1" if data.pop(f[0], None) is not None else b"0")
            elif code == ops["num_keys"]:
                return frames.frame(frames.OK, str(len(data)).encode())
            elif code == ops["append"]:
                data[f[0]] = data.get(f[0], b"") + f[1]
            elif code == ops["list_keys"]:
                return frames.frame(frames.OK, *data)
            elif code == ops["multi_set"]:
                half = len(f) // 2
                data.update(zip(f[:half], f[half:]))
            else:
                return frames.frame(frames.BAD, f"unknown operation {code}".encode())
        except (IndexError, ValueError) as exc:
            return frames.frame(frames.BAD, f"malformed request: {exc}".encode())
        return frames.frame(frames.OK)

    def _send(self, conn: _Conn, data: bytes) -> None:
        conn.out += data
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(conn.sock)
            return
        del conn.out[:sent]
        self._want_write(conn.sock, bool(conn.out))
