"""Rank 0's side of the fail-fast hub: one thread that listens, serves the ranks and relays failures.

Only connections that open with the job's secret count: anything else is
dropped, and no input ends the serve thread (docs/reliability.md, "The
hub's threat model").  What to answer is the judge's (``judge.py``); the
words are the hub's messages (``messages.py``).
"""

from __future__ import annotations

import collections
import json
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from spmd.failfast import report
from spmd.failfast.abort import PEER_EXIT
from spmd.failfast.hub import messages
from spmd.failfast.hub.base import Hub, Reply
from spmd.failfast.hub.judge import Gathering, Verdicts, death
from spmd.failfast.hub.peers import Peers

__all__ = ["HubServer", "HELLO_WITHIN", "MAX_PENDING", "ACCEPT_BATCH", "CLOSE_WAIT"]

#: Seconds a new connection has to present the job's secret before the hub closes it.
HELLO_WITHIN = 1.0
#: Connections that have not presented the secret yet, at most; beyond, the oldest is closed.
MAX_PENDING = 64
#: Connections the hub accepts in one pass before it serves the ones it has.
ACCEPT_BATCH = 256
#: Seconds close() waits for a rank whose greeting has not been read yet.
CLOSE_WAIT = 2.0


class HubServer(Hub):
    """Rank 0's hub: every other rank's connection, the one report of failures and of stacks."""

    def __init__(self, rank: int, size: int, share: Callable[[str | None], str], local_only: bool,
                 timeout: float, monitors: Sequence[Any] = (), host: str | None = None) -> None:
        super().__init__(rank, size, share, local_only, timeout, monitors)
        self._server, host = messages.listen(local_only, size, host)
        self._server.setblocking(False)
        self._secret = messages.new_secret()
        #: (host, port) where the hub listens, as the other ranks are told.
        self.address = (host, self._server.getsockname()[1])
        share(messages.invitation(host, self.address[1], self._secret))
        self._peers = Peers()
        self._aborted = False  # the job was ended (a rank failed or died): a late greeting hears ABORT
        # The rest is the serve thread's alone.
        self._pending: dict[socket.socket, float] = {}  # socket -> deadline for its greeting, oldest first
        self._readers: dict[socket.socket, messages.Reader] = {}  # every open connection's
        self._met: set[int] = set()  # ranks that ever presented the secret
        self._noted: set[str] = set()  # kinds of junk already reported on stderr
        self._requests: collections.deque[Callable[[], None]] = collections.deque()  # rank 0's own, for this thread
        self._verdicts = Verdicts()
        self._stacks = Gathering(size)
        self._done = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._serve, name="spmd-hub", daemon=True)
        self._thread.start()

    # -- serving -----------------------------------------------------------------

    def _serve(self) -> None:
        self._sel.register(self._server, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        while not self._done.is_set():
            self._step(0.25)
        self._finish()

    def _step(self, timeout: float) -> None:
        """Serve what is ready within timeout, then close connections past their greeting's deadline."""
        try:
            now = time.monotonic()
            for deadline in (self._verdicts.deadline(), self._stacks.deadline):
                if deadline is not None:
                    timeout = max(0.0, min(timeout, deadline - now))
            for key, _ in self._sel.select(timeout):
                conn = key.fileobj
                if conn is self._server:
                    self._accept()
                elif conn is self._wake_r:
                    self._wake_r.recv(64)
                elif conn in self._readers:  # not closed earlier in this pass
                    self._serve_one(conn)
            while self._requests:
                self._requests.popleft()()
            self._expire()
            self._tick()
        except Exception as exc:  # this thread must outlive anything it is sent
            self._note("error", f"the fail-fast hub recovered from {exc!r}")
            time.sleep(0.05)

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            self._read(conn)
        except Exception as exc:  # one connection's trouble is that connection's end, not the loop's
            self._note("error", f"the fail-fast hub dropped a connection after {exc!r}")
            self._drop(conn)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, say: make room
                self._note("accept", f"the fail-fast hub could not accept a connection ({exc})")
                if self._pending:
                    self._evict()
                else:
                    time.sleep(0.05)  # not ours to free: do not spin on it
                return
            conn.setblocking(False)
            self._pending[conn] = time.monotonic() + HELLO_WITHIN
            self._readers[conn] = messages.Reader()
            self._sel.register(conn, selectors.EVENT_READ)
            while len(self._pending) > MAX_PENDING:
                self._note("flood", f"the fail-fast hub held {MAX_PENDING} connections that had not greeted it "
                                    "and closed the oldest")
                self._evict()

    def _evict(self) -> None:
        """Close the oldest unauthenticated connection, unless its greeting is waiting."""
        if not self._pending:
            return
        conn = next(iter(self._pending))
        self._serve_one(conn)  # a rank's HELLO may be there, unread
        if conn in self._pending:
            self._drop(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        for conn, deadline in list(self._pending.items()):
            if deadline > now:
                break  # the rest came later
            self._note("slow", f"the fail-fast hub closed a connection that sent no greeting within {HELLO_WITHIN:g} s")
            self._drop(conn)

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._lost(conn)
            return
        reader = self._readers[conn]
        for kind, got in reader.feed(data):
            if kind is messages.TOO_LONG:
                self._drop(conn)
                return
            if kind is messages.PAYLOAD:
                self._stack(conn, got)
            else:
                self._message(conn, reader, got)
            if conn not in self._readers:  # the message closed it
                return

    def _message(self, conn: socket.socket, reader: messages.Reader, line: bytes) -> None:
        rank = self._peers.rank_of(conn)
        if rank is None:  # its first line, and the only one it may send: HELLO <rank> <secret>
            self._hello(conn, line)
            return
        said = messages.rank_says(line)
        if said is None:
            self._note("word", f"the fail-fast hub ignored a message from rank {rank}: {line[:40]!r}")
        elif said[0] == messages.FAIL:
            self._abort_all(None)
        elif said[0] == messages.BYE:
            self._peers.remove(conn)
        elif said[0] == messages.ERR:
            self._failed(rank, said[1], Reply(lambda lead: self._peers.write(conn, messages.verdict(rank, lead))))
        elif said[0] == messages.WHERE:
            answer = Reply(lambda text: self._peers.write(conn, messages.report(text), 2.0))  # its thread reads at once
            self._ask_stacks(rank, said[1], said[2], answer)
        else:  # STACK <n>: n bytes of its answer to STACKS follow
            reader.expect(said[1])

    def _hello(self, conn: socket.socket, line: bytes) -> None:
        rank, wrong = messages.check_hello(line, self.size, self._secret)
        if wrong == "hello":
            self._note("hello", f"the fail-fast hub closed a connection from {messages.peer_name(conn)} that did not "
                                "greet it as a rank does")
        elif wrong == "secret":
            self._note("secret", f"the fail-fast hub closed a connection from {messages.peer_name(conn)} with a wrong "
                                 "secret")
        if rank is None:
            self._drop(conn)
            return
        self._pending.pop(conn, None)  # (a rank that said BYE is no longer pending)
        self._peers.add(conn, rank)
        self._met.add(rank)
        if self._aborted:  # it greets after the job was ended: it must hear so too
            self._peers.write(conn, messages.line(messages.ABORT))

    def _lost(self, conn: socket.socket) -> None:
        """The other end closed conn: a death if it was a rank that had not said BYE."""
        rank = self._peers.rank_of(conn)
        self._drop(conn)
        if rank is not None and not self._closing:
            self._abort_all(death(rank, self.size))

    def _drop(self, conn: socket.socket) -> None:
        self._peers.remove(conn)
        self._pending.pop(conn, None)
        self._readers.pop(conn, None)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _note(self, kind: str, text: str) -> None:
        """Say text on stderr, the first time something of this kind happens."""
        if kind in self._noted:
            return
        self._noted.add(kind)
        try:
            sys.stderr.write(f"### spmd: {text} (reported once; the job goes on)\n")
            sys.stderr.flush()
        except Exception:  # stderr closed: the hub serves on regardless
            pass

    # -- one report per job --------------------------------------------------------

    def _failed(self, rank: int, digest: str, waiter: Reply) -> None:
        """rank failed with this digest: answer at the window's end, or at once once it has passed."""
        for reply, lead in self._verdicts.failed(rank, digest, waiter, time.monotonic()):
            reply.set(lead)

    def _tick(self) -> None:
        """Answer the failures once the window has passed; end a gather past its deadline."""
        now = time.monotonic()
        for reply, lead in self._verdicts.due(now):
            reply.set(lead)
        if self._stacks.overdue(now):
            self._end_gather()

    def _ask_stacks(self, rank: int, reason: bytes, wait: float, waiter: Reply) -> None:
        """rank asked where every rank is: ask each (once for every asker now), answer waiter at the end."""
        now = time.monotonic()
        text = self._stacks.reusable(reason == b"timeout", now)
        if text is not None:
            waiter.set(text)
            return
        if self._stacks.ask(waiter, messages.REASONS[reason].format(rank), wait, now,
                            lambda: report.where(0, self.monitors)):
            self._peers.tell_all(messages.line(messages.STACKS))
        if self._stacks.complete():
            self._end_gather()

    def _stack(self, conn: socket.socket, payload: bytes) -> None:
        """A rank's answer to STACKS."""
        rank = self._peers.rank_of(conn)
        if self._stacks.deadline is None or rank is None:
            return
        try:
            summary = json.loads(payload.decode("utf-8", "replace"))
        except ValueError:
            self._note("stack", f"the fail-fast hub could not read rank {rank}'s stacks")
            return
        self._stacks.answered(rank, summary)
        if self._stacks.complete():
            self._end_gather()

    def _end_gather(self) -> None:
        text, waiters = self._stacks.end(time.monotonic())
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except Exception:
            pass
        for waiter in waiters:
            waiter.set(text)

    def _abort_all(self, message: str | None) -> None:
        self._closing = self._aborted = True
        self._peers.tell_all(messages.line(messages.ABORT))
        self._end(PEER_EXIT, f"### spmd: {message}; ending the job" if message else None)

    def _finish(self) -> None:
        """Say BYE to every rank and close everything, once every rank's greeting is read."""
        # Under load a rank's greeting may not be read yet (its connection not even
        # accepted): one closed unread would read, on that rank, as rank 0's death.
        deadline = time.monotonic() + CLOSE_WAIT
        try:
            self._accept()
            while self._pending and len(self._met) < self.size - 1 and time.monotonic() < deadline:
                self._step(0.05)
            self._peers.tell_all(messages.line(messages.BYE))
        finally:
            for conn in list(self._readers):
                self._drop(conn)
            self._sel.close()
            for sock in (self._server, self._wake_r, self._wake_w):
                sock.close()

    # -- rank 0's own calls, from any thread -----------------------------------------

    def _ask_verdict(self, digest: str) -> bool:
        self._call(lambda: self._failed(0, digest, self._verdict))
        return True

    def _ask_where(self, reason: bytes, wait: float, reply: Reply | None) -> bool:
        self._call(lambda: self._ask_stacks(0, reason, wait, reply or Reply()))
        return True

    def fail(self) -> None:
        """Tell every rank that this one failed (it prints its own traceback)."""
        self._closing = self._aborted = True
        self._peers.tell_all(messages.line(messages.ABORT))

    def close(self) -> None:
        """Leave normally: say BYE, so that no rank takes it for a death."""
        self._closing = True
        self._done.set()
        self._wake()
        self._thread.join(timeout=CLOSE_WAIT + 3.0)

    def _call(self, request: Callable[[], None]) -> None:
        """Run request on the serve thread, soon."""
        self._requests.append(request)
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

