"""Rank 0's side of the job store: one thread that serves every member's requests.

A connection is served only after it answered the challenge with the job's
secret within HELLO_WITHIN seconds; anything else is closed unread, and no
input ends the thread.  A request for a key not yet set (get, wait,
multi_get) is answered when the key is set: the client bounds the wait.
"""

from __future__ import annotations

import hmac
import ipaddress
import selectors
import socket
import sys
import threading
import time

from spmd.runtime.jobstore import frames

__all__ = ["StoreServer", "bind", "HELLO_WITHIN", "MAX_PENDING"]

#: Seconds a new connection has to answer the challenge.
HELLO_WITHIN = 5.0
#: Connections that have not answered yet, at most; beyond, the oldest is closed.
MAX_PENDING = 64
_WAITS = {frames.OPS["get"], frames.OPS["wait"], frames.OPS["multi_get"]}


def bind(addr: str, port: int, backlog: int) -> socket.socket:
    """A listening socket on addr's own interface (never a wildcard) and port (0: any free one)."""
    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    error: OSError | None = None
    for family, _, _, _, sockaddr in infos:
        try:
            return socket.create_server(sockaddr[:2], family=family, backlog=backlog)
        except OSError as exc:
            error = exc
    raise error if error is not None else OSError(f"{addr} has no address")


def is_wildcard(host: str) -> bool:
    """Whether host is an address that listens on every interface."""
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_unspecified
    except ValueError:
        return host == ""


class _Conn:
    """One connection: its greeting's deadline until it answers, then its frames and unsent bytes."""

    def __init__(self, sock: socket.socket, nonce: bytes) -> None:
        self.sock, self.nonce = sock, nonce
        self.deadline: float | None = time.monotonic() + HELLO_WITHIN
        self.hello = bytearray()
        self.frames = frames.Frames()
        self.out = bytearray()


class StoreServer:
    """Serve the job's keys on sock (bound, listening) to connections that know secret."""

    def __init__(self, sock: socket.socket, secret: bytes) -> None:
        sock.setblocking(False)
        self._sock, self._secret = sock, secret
        self.address = sock.getsockname()[:2]
        self._data: dict[bytes, bytes] = {}
        self._conns: dict[socket.socket, _Conn] = {}
        self._waiting: list[tuple[_Conn, int, list[bytes]]] = []
        self._noted: set[str] = set()
        self._done = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(sock, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._serve, name="spmd-store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close every connection (the members' next request fails)."""
        if not self._done.is_set():
            self._done.set()
            self._wake_w.send(b"x")
            if threading.current_thread() is not self._thread:
                self._thread.join(5)

    # -- the thread ----------------------------------------------------------------

    def _serve(self) -> None:
        while not self._done.is_set():
            try:
                self._step()
            except Exception as exc:  # this thread must outlive anything it is sent
                self._note("error", f"spmd: the job store recovered from {exc!r}")
                time.sleep(0.05)
        for sock in [*self._conns, self._sock, self._wake_r, self._wake_w]:
            sock.close()
        self._sel.close()

    def _step(self) -> None:
        pending = [c.deadline for c in self._conns.values() if c.deadline is not None]
        timeout = max(0.0, min(pending) - time.monotonic()) if pending else None
        for key, events in self._sel.select(timeout):
            sock = key.fileobj
            if sock is self._sock:
                self._accept()
            elif sock is self._wake_r:
                self._wake_r.recv(64)
            elif sock in self._conns:
                conn = self._conns[sock]
                if events & selectors.EVENT_WRITE:
                    self._flush(conn)
                if events & selectors.EVENT_READ and sock in self._conns:
                    self._read(conn)
        now = time.monotonic()
        for conn in [c for c in self._conns.values() if c.deadline is not None and c.deadline < now]:
            self._refuse(conn, "did not answer the challenge in time")

    def _accept(self) -> None:
        for _ in range(256):
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, say
                self._note("accept", f"spmd: the job store could not accept a connection ({exc})")
                return
            sock.setblocking(False)
            greeting, nonce = frames.challenge()
            conn = _Conn(sock, nonce)
            self._conns[sock] = conn
            self._sel.register(sock, selectors.EVENT_READ)
            self._send(conn, greeting)
            strangers = [c for c in self._conns.values() if c.deadline is not None]
            if len(strangers) > MAX_PENDING:
                self._refuse(strangers[0], "waited while too many others did")

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
        elif conn.deadline is not None:
            self._greet(conn, data)
        else:
            self._serve_frames(conn, data)

    def _serve_frames(self, conn: _Conn, data: bytes) -> None:
        try:
            got = conn.frames.feed(data)
        except OverflowError as exc:
            self._note("frame", f"spmd: the job store closed a member's connection after {exc}")
            self._drop(conn)
            return
        for code, fields in got:
            self._request(conn, code, fields)

    def _greet(self, conn: _Conn, data: bytes) -> None:
        conn.hello += data
        if b"\n" not in conn.hello:
            if len(conn.hello) > 128:
                self._refuse(conn, "sent something else than the answer")
            return
        line, rest = bytes(conn.hello).split(b"\n", 1)
        if not hmac.compare_digest(line + b"\n", frames.answer(self._secret, conn.nonce)):
            self._refuse(conn, "did not prove it belongs to the job")
            return
        conn.deadline, conn.hello = None, bytearray()
        if rest:
            self._serve_frames(conn, rest)

    def _refuse(self, conn: _Conn, why: str) -> None:
        try:
            peer = conn.sock.getpeername()[0]
        except OSError:
            peer = "an unknown address"
        self._note(why, f"spmd: the job store closed a connection from {peer} that {why}")
        self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock, None)
        self._waiting = [w for w in self._waiting if w[0] is not conn]
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _note(self, kind: str, text: str) -> None:
        if kind not in self._noted:  # once per kind: an outsider cannot fill rank 0's stderr
            self._noted.add(kind)
            print(text, file=sys.stderr, flush=True)

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
            self._drop(conn)
            return
        del conn.out[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        self._sel.modify(conn.sock, events)
