"""Rank 0's side of the fail-fast hub: one thread that listens, serves the ranks and relays failures.

Only connections that open with the job's secret count: the accepting,
the greeting's deadline and the cap on strangers are
``spmd.util.authserver``'s, and no input ends the serve thread
(docs/reliability.md, "The hub's threat model").  What to answer is the
judge's (``judge.py``); the words are the hub's messages (``messages.py``).
With a heartbeat, the thread says BEAT to every rank each interval and
ends the job, naming the hosts, when ranks have been silent for
``judge.MISSES`` intervals (docs/reliability.md, "Host faults").
"""

from __future__ import annotations

import collections
import ipaddress
import json
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from spmd.failfast import report
from spmd.failfast.abort import PEER_EXIT
from spmd.failfast.hub import messages
from spmd.failfast.hub.base import Hub, Reply
from spmd.failfast.hub.judge import Gathering, Silence, Verdicts, death, silence
from spmd.failfast.hub.peers import Peers
from spmd.util.authserver import AuthServer

__all__ = ["HubServer", "listen", "HOST_DEATH_WAIT"]

#: Seconds the hub waits, after a rank on another host died, for that host's other ranks' deaths,
#: so that one report names them all (a host that died with every process on it).
HOST_DEATH_WAIT = 0.25


class HubServer(AuthServer, Hub):
    """Rank 0's hub: every other rank's connection, the one report of failures and of stacks."""

    _tick = 0.25

    def __init__(self, rank: int, size: int, share: Callable[[str | None], str], local_only: bool,
                 timeout: float, monitors: Sequence[Any] = (), host: str | None = None, name: str | None = None,
                 beat: float = 0.0) -> None:
        Hub.__init__(self, rank, size, share, local_only, timeout, monitors, name, beat)
        server, host = listen(local_only, size, host)
        AuthServer.__init__(self, server, "the fail-fast hub", "spmd-hub")
        self._secret = messages.new_secret()
        #: (host, port) where the hub listens, as the other ranks are told.
        self.address = (host, server.getsockname()[1])
        share(messages.invitation(host, self.address[1], self._secret, self.name))
        self._peers = Peers()
        self._aborted = False  # the job was ended (a rank failed or died): a late greeting hears ABORT
        self._hosts: dict[int, str] = {0: self.name} if self.name else {}  # each rank's host, as it said
        self._silence = Silence(beat) if beat > 0 else None  # who has not beaten lately
        self._next_beat = time.monotonic() + beat
        self._dead: list[int] = []  # ranks whose connections closed without a word, not yet reported
        self._dead_due = 0.0  # when to report them
        # The rest is the serve thread's alone.
        self._readers: dict[socket.socket, messages.Reader] = {}  # every rank's connection's
        self._met: set[int] = set()  # ranks that ever presented the secret
        self._requests: collections.deque[Callable[[], None]] = collections.deque()  # rank 0's own, for this thread
        self._verdicts = Verdicts()
        self._stacks = Gathering(size)
        self._start()

    # -- serving: what the hub's protocol adds to AuthServer --------------------------

    def _admit(self, conn: socket.socket, line: bytes, token: object) -> tuple[str, str] | None:
        """A connection's first line, and the only one it may send before it counts: HELLO <rank> <secret>."""
        rank, host, wrong = messages.check_hello(line, self.size, self._secret)
        if wrong == "hello":
            return "hello", "that did not greet it as a rank does"
        if rank is None:
            return "secret", "with a wrong secret"
        self._peers.add(conn, rank)
        self._readers[conn] = messages.Reader()
        self._met.add(rank)
        if host:
            self._hosts[rank] = host
        if self._silence is not None:
            self._silence.heard(rank, time.monotonic())
        if self._aborted:  # it greets after the job was ended: it must hear so too
            self._peers.write(conn, messages.line(messages.ABORT))
        return None

    def _received(self, conn: socket.socket, data: bytes) -> None:
        reader = self._readers[conn]
        rank = self._peers.rank_of(conn)
        if self._silence is not None and rank is not None:  # any word counts as a beat
            self._silence.heard(rank, time.monotonic())
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
        if rank is None:  # it said BYE: nothing it says counts any more
            return
        said = messages.rank_says(line)
        if said is None:
            self._note("word", f"the fail-fast hub ignored a message from rank {rank}: {line[:40]!r}")
        elif said[0] == messages.FAIL:
            self._abort_all(None)
        elif said[0] == messages.BEAT:
            pass  # heard: _received noted it
        elif said[0] == messages.BYE:
            self._peers.remove(conn)
            if self._silence is not None:
                self._silence.forget(rank)
        elif said[0] == messages.ERR:
            self._failed(rank, said[1], Reply(lambda lead: self._peers.write(conn, messages.verdict(rank, lead))))
        elif said[0] == messages.WHERE:
            answer = Reply(lambda text: self._peers.write(conn, messages.report(text), 2.0))  # its thread reads at once
            self._ask_stacks(rank, said[1], said[2], answer)
        else:  # STACK <n>: n bytes of its answer to STACKS follow
            reader.expect(said[1])

    def _lost(self, conn: socket.socket) -> None:
        """The other end closed conn: a death if it was a rank that had not said BYE."""
        rank = self._peers.rank_of(conn)
        self._drop(conn)
        if rank is not None and not self._closing:  # the job ends after this pass (or HOST_DEATH_WAIT)
            if not self._dead:
                away = self._hosts.get(rank, self.name) != self.name
                self._dead_due = time.monotonic() + (HOST_DEATH_WAIT if away else 0.0)
            self._dead.append(rank)

    def _forget(self, conn: socket.socket) -> None:
        rank = self._peers.rank_of(conn)
        if rank is not None and self._silence is not None:
            self._silence.forget(rank)
        self._peers.remove(conn)
        self._readers.pop(conn, None)

    def _due(self) -> float | None:
        due = [d for d in (self._verdicts.deadline(), self._stacks.deadline) if d is not None]
        if self._silence is not None and not self._closing:
            due += [d for d in (self._next_beat, self._silence.deadline()) if d is not None]
        if self._dead and not self._closing:
            due.append(self._dead_due)
        return min(due) if due else None

    def _after_pass(self) -> None:
        while self._requests:
            self._requests.popleft()()
        self._tick_judge()
        if self._dead and not self._closing and time.monotonic() >= self._dead_due:
            self._abort_all(death(self._dead, self.size, self._hosts, self.name))
        if self._silence is not None and not self._closing:
            self._tick_heart()

    def _tick_heart(self) -> None:
        """Beat when due; end the job when ranks have been silent for MISSES beats."""
        now = time.monotonic()
        if now >= self._next_beat:
            self._next_beat = now + self._silence.interval
            self._peers.tell_all(messages.line(messages.BEAT))
        silent = self._silence.silent(now)
        if silent:
            self._abort_all(silence(silent, self._hosts, self.name, self.size))

    def _awaits_greetings(self) -> bool:
        return len(self._met) < self.size - 1

    def _farewell(self) -> None:
        self._peers.tell_all(messages.line(messages.BYE))

    # -- one report per job --------------------------------------------------------

    def _failed(self, rank: int, digest: str, waiter: Reply) -> None:
        """rank failed with this digest: answer at the window's end, or at once once it has passed."""
        for reply, lead in self._verdicts.failed(rank, digest, waiter, time.monotonic()):
            reply.set(lead)

    def _tick_judge(self) -> None:
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
        said = f"### spmd: {message}; ending the job" if message else None

        def abort() -> None:
            self._peers.tell_all(messages.line(messages.ABORT))

        if self._reporting.is_set() and not self._printed.is_set():  # its report first, then these words
            abort()
            self._end(PEER_EXIT, said)
        else:  # the words before any rank hears ABORT: a launcher that ends the job when the first rank
            self._exit(PEER_EXIT, said, before=abort)  # exits (Hydra) would cut off output still in a pipe

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
        super().close()

    def _call(self, request: Callable[[], None]) -> None:
        """Run request on the serve thread, soon."""
        self._requests.append(request)
        self._wake()


def listen(local_only: bool, size: int, host: str | None = None) -> tuple[socket.socket, str]:
    """Bind the hub where the other ranks will be told to connect; return (socket, that address).

    host: an address of this host the others reach (the rendezvous store's), tried first across hosts.
    """
    backlog = max(size, socket.SOMAXCONN)
    if local_only:
        return socket.create_server(("127.0.0.1", 0), backlog=backlog), "127.0.0.1"
    if host:
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            return socket.create_server((host, 0), family=family, backlog=backlog), host
        except OSError:
            pass
    host = socket.gethostname()
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        infos = []
    for family, _, _, _, sockaddr in infos:
        ip = ipaddress.ip_address(sockaddr[0].split("%")[0])
        if ip.is_loopback or ip.is_link_local:  # Debian maps the host name to 127.0.1.1
            continue
        try:
            return socket.create_server((str(ip), 0), family=family, backlog=backlog), str(ip)
        except OSError:
            continue
    # No address of this host's name can be bound (and no store's address: the mpi backend): every
    # interface, guarded by the secret alone.
    return socket.create_server(("", 0), backlog=backlog), host
