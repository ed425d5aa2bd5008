"""An authenticated server's thread: binding, accepting, the greeting, the cap on strangers, closing.

``AuthServer`` is what the fail-fast hub and the job store share: one
thread with a selector, where a new connection is a stranger until its
first line (the greeting, at most MAX_GREETING bytes) passes the
server's check, within HELLO_WITHIN seconds; a stranger that stays
silent, says something else or sends too much is closed unread.  At most
MAX_PENDING strangers are held (beyond, the oldest is read once, in case
its greeting waits, then closed), at most ACCEPT_BATCH accepted per pass,
and no input ends the thread.  A subclass keeps only its protocol: what
it sends first, how it checks a greeting, what it does with a member's
bytes.  ``challenge``/``answer``: a greeting that never sends the secret.
docs/reliability.md, "Sockets and strangers".
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import selectors
import socket
import sys
import threading
import time

__all__ = ["AuthServer", "HELLO_WITHIN", "MAX_PENDING", "ACCEPT_BATCH", "MAX_GREETING", "CLOSE_WAIT", "bind",
           "is_wildcard", "peer_name", "challenge", "answer"]

#: Seconds a new connection has to greet the server.  Long enough for a member that must first
#: read a challenge, on a host whose ranks all start at once (a member refused is a failed init,
#: or a rank that takes rank 0 for dead); an outsider gains nothing from it, since MAX_PENDING
#: bounds what strangers hold and the oldest makes room for a newcomer.
HELLO_WITHIN = 5.0
#: Connections that have not greeted the server yet, at most; beyond, the oldest is closed.
MAX_PENDING = 64
#: Connections accepted in one pass before the server serves the ones it has.
ACCEPT_BATCH = 256
#: Bytes of a greeting, its newline included, at most.
MAX_GREETING = 256
#: Seconds close() waits for greetings not read yet, where the server still expects some.
CLOSE_WAIT = 2.0


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


def peer_name(conn: socket.socket) -> str:
    """The address conn comes from, for a message."""
    try:
        return conn.getpeername()[0]
    except OSError:
        return "an unknown address"


def challenge(prefix: bytes) -> tuple[bytes, bytes]:
    """A server's opening line (prefix, then a fresh 128-bit nonce) and the nonce in it."""
    nonce = secrets.token_hex(16).encode()
    return prefix + nonce + b"\n", nonce


def answer(secret: bytes, nonce: bytes) -> bytes:
    """What a holder of secret answers to nonce: the HMAC-SHA256 under the secret, as a line."""
    return hmac.new(secret, nonce, hashlib.sha256).hexdigest().encode() + b"\n"


class _Stranger:
    """A connection that has not greeted the server yet: its deadline, what it sent, the server's token."""

    __slots__ = ("deadline", "heard", "token")

    def __init__(self, token: object) -> None:
        self.deadline = time.monotonic() + HELLO_WITHIN
        self.heard = bytearray()
        self.token = token


class AuthServer:
    """One thread that serves, on a listening socket, only the connections whose greeting passes a check.

    A subclass implements ``_admit`` (and, as its protocol needs, the
    other hooks below), then calls ``_start()`` once its own state is
    ready.  title names the server in what it says on stderr.
    """

    #: Seconds the thread waits at most between passes (None: until something happens).
    _tick: float | None = None

    def __init__(self, sock: socket.socket, title: str, thread_name: str) -> None:
        sock.setblocking(False)
        self._server, self.title = sock, title
        self._pending: dict[socket.socket, _Stranger] = {}  # oldest first
        self._members: set[socket.socket] = set()
        self._noted: set[str] = set()  # kinds of trouble already said on stderr
        self._done = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._serve, name=thread_name, daemon=True)

    def _start(self) -> None:
        self._sel.register(self._server, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close every connection (after CLOSE_WAIT at most for greetings awaited)."""
        if self._done.is_set():
            return
        self._done.set()
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(CLOSE_WAIT + 3.0)

    # -- the protocol's hooks ----------------------------------------------------------

    def _challenge(self) -> tuple[bytes, object]:
        """What to send a new connection first, and a token _admit is handed back (default: nothing)."""
        return b"", None

    def _admit(self, conn: socket.socket, line: bytes, token: object) -> tuple[str, str] | None:
        """Check conn's greeting (line, without its newline): None admits it as a member; else
        (kind, what it did wrong, as words after 'a connection from ADDR'), and it is closed."""
        raise NotImplementedError

    def _received(self, conn: socket.socket, data: bytes) -> None:
        """A member sent data (what followed its greeting, first)."""
        raise NotImplementedError

    def _writable(self, conn: socket.socket) -> None:
        """A member's socket takes more bytes (asked for with _want_write)."""

    def _lost(self, conn: socket.socket) -> None:
        """A member closed its end."""
        self._drop(conn)

    def _forget(self, conn: socket.socket) -> None:
        """conn is being closed: drop what the protocol keeps of it."""

    def _due(self) -> float | None:
        """The next moment (time.monotonic()) the protocol has something to do, or None."""
        return None

    def _after_pass(self) -> None:
        """Run after every pass of the thread."""

    def _awaits_greetings(self) -> bool:
        """Whether close() should wait (CLOSE_WAIT) for greetings not read yet."""
        return False

    def _farewell(self) -> None:
        """Said to the members before everything is closed."""

    # -- the thread ------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._done.is_set():
            self._step(self._tick)
        self._finish()

    def _step(self, timeout: float | None) -> None:
        """Serve what is ready within timeout, then close the strangers past their deadline."""
        try:
            due = [d for d in (self._due(), self._oldest()) if d is not None]
            if due:
                wait = max(0.0, min(due) - time.monotonic())
                timeout = wait if timeout is None else min(timeout, wait)
            for key, events in self._sel.select(timeout):
                conn = key.fileobj
                if conn is self._server:
                    self._accept()
                elif conn is self._wake_r:
                    self._wake_r.recv(64)
                elif conn in self._members or conn in self._pending:  # not closed earlier in this pass
                    self._serve_one(conn, events)
            self._after_pass()
            self._expire()
        except Exception as exc:  # this thread must outlive anything it is sent
            self._note("error", f"{self.title} recovered from {exc!r}")
            time.sleep(0.05)

    def _oldest(self) -> float | None:
        """The deadline of the oldest stranger's greeting, or None."""
        return next(iter(self._pending.values())).deadline if self._pending else None

    def _serve_one(self, conn: socket.socket, events: int = selectors.EVENT_READ) -> None:
        try:
            if events & selectors.EVENT_WRITE and conn in self._members:
                self._writable(conn)
            if events & selectors.EVENT_READ and (conn in self._members or conn in self._pending):
                self._read(conn)
        except Exception as exc:  # one connection's trouble is that connection's end, not the loop's
            self._note("error", f"{self.title} dropped a connection after {exc!r}")
            self._drop(conn)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, say: make room
                self._note("accept", f"{self.title} could not accept a connection ({exc})")
                if self._pending:
                    self._evict()
                else:
                    time.sleep(0.05)  # not ours to free: do not spin on it
                return
            conn.setblocking(False)
            opening, token = self._challenge()
            self._pending[conn] = _Stranger(token)
            self._sel.register(conn, selectors.EVENT_READ)
            if opening:
                try:
                    conn.send(opening)  # a few bytes into an empty buffer
                except OSError:
                    self._drop(conn)
                    continue
            while len(self._pending) > MAX_PENDING:
                self._note("flood", f"{self.title} held {MAX_PENDING} connections that had not greeted it "
                                    "and closed the oldest")
                self._evict()

    def _evict(self) -> None:
        """Close the oldest stranger, unless its greeting is waiting."""
        conn = next(iter(self._pending))
        self._serve_one(conn)  # a member's greeting may be there, unread
        if conn in self._pending:
            self._drop(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        for conn, stranger in list(self._pending.items()):
            if stranger.deadline > now:
                break  # the rest came later
            self._note("slow", f"{self.title} closed a connection that sent no greeting within {HELLO_WITHIN:g} s")
            self._drop(conn)

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            if conn in self._members:
                self._lost(conn)
            else:
                self._drop(conn)
        elif conn in self._members:
            self._received(conn, data)
        else:
            self._greet(conn, data)

    def _greet(self, conn: socket.socket, data: bytes) -> None:
        stranger = self._pending[conn]
        stranger.heard += data
        end = stranger.heard.find(b"\n", 0, MAX_GREETING)
        if end < 0:
            if len(stranger.heard) >= MAX_GREETING:
                self._refuse(conn, "long", f"that sent more than {MAX_GREETING} bytes without a greeting")
            return
        line, rest = bytes(stranger.heard[:end]), bytes(stranger.heard[end + 1:])
        wrong = self._admit(conn, line, stranger.token)
        if wrong is not None:
            self._refuse(conn, *wrong)
            return
        del self._pending[conn]
        self._members.add(conn)
        if rest:
            self._received(conn, rest)

    def _refuse(self, conn: socket.socket, kind: str, what: str) -> None:
        self._note(kind, f"{self.title} closed a connection from {peer_name(conn)} {what}")
        self._drop(conn)

    def _finish(self) -> None:
        """Wait for the greetings still awaited (CLOSE_WAIT at most), say farewell, close everything."""
        # Under load a member's greeting may not be read yet (its connection not even accepted):
        # one closed unread would read, on that member, as the server's death.
        deadline = time.monotonic() + CLOSE_WAIT
        try:
            self._accept()
            while self._pending and self._awaits_greetings() and time.monotonic() < deadline:
                self._step(0.05)
            self._farewell()
        finally:
            for conn in [*self._pending, *self._members]:
                self._drop(conn)
            self._sel.close()
            for sock in (self._server, self._wake_r, self._wake_w):
                sock.close()

    # -- for the protocol ----------------------------------------------------------------

    def _drop(self, conn: socket.socket) -> None:
        """Close conn, a stranger or a member."""
        self._pending.pop(conn, None)
        self._members.discard(conn)
        self._forget(conn)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _want_write(self, conn: socket.socket, wanted: bool) -> None:
        """Whether the thread should call _writable when conn, a member, takes more bytes."""
        self._sel.modify(conn, selectors.EVENT_READ | (selectors.EVENT_WRITE if wanted else 0))

    def _wake(self) -> None:
        """Wake the thread now."""
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _note(self, kind: str, text: str) -> None:
        """Say text on stderr, the first time something of this kind happens (an outsider cannot fill it)."""
        if kind in self._noted:
            return
        self._noted.add(kind)
        try:
            sys.stderr.write(f"### spmd: {text} (reported once; the job goes on)\n")
            sys.stderr.flush()
        except Exception:  # stderr closed: the server serves on regardless
            pass
