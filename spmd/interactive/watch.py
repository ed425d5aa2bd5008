"""One block on its ranks, watched by the host: replies, interrupts, the timeout, deaths.

``Watch.run`` waits for every rank's reply to a block.  An interrupt (from
the front end, or a SIGINT a rank got from its launcher) is passed to every
rank still running; past the block's timeout the ranks are asked where
they are first.  Ranks that have not stopped GRACE seconds after an
interrupt sit inside a call nobody can cancel: the host starts the world
afresh where it can (forked ranks), else the session ends.  A rank that
dies ends the world.  A ``Rank`` is what the host knows of one rank.
"""

from __future__ import annotations

import os
import select
import socket
import time
from typing import Any

from spmd.util import pickled
from spmd.util.words import exit_text, ranks_text

__all__ = ["Rank", "Watch", "GRACE", "ASK", "MARGIN"]

#: Seconds interrupted ranks get to stop before they count as stuck.
GRACE = 2.0
#: Seconds ranks get to say where they are.
ASK = 1.0
#: Seconds past a block's timeout before the host acts (spmd's own collective timeout is heard first).
MARGIN = 1.0
#: Errors after which a world's communicator cannot be trusted.
BROKEN = ("CollectiveTimeout", "PeerLostError", "CommunicationError")


class Rank:
    def __init__(self, rank: int, pid: int | None, sock: socket.socket) -> None:
        self.rank, self.pid, self.sock = rank, pid, sock  # pid None: a rank a launcher started, elsewhere
        self.status: int | None = None  # os.waitstatus_to_exitcode once reaped
        self.ended: str | None = None  # how it ended, in words, once gone
        self.where: dict[str, Any] | None = None

    @property
    def gone(self) -> bool:
        return self.ended is not None

    def reap(self) -> None:
        if self.ended is not None:
            return
        if self.pid is None:
            self.ended = "closed its connection (it died, or its launcher ended it)"
        else:
            _, status = os.waitpid(self.pid, 0)
            self.status = os.waitstatus_to_exitcode(status)
            self.ended = exit_text(self.status)
        self.sock.close()


class Watch:
    """One block on its ranks: replies, the front end's interrupt, the timeout, deaths."""

    def __init__(self, host: Any, targets: list[Rank], timeout: float | None) -> None:
        self.host, self.targets = host, targets
        self.timeout = timeout
        self.results: dict[int, dict[str, Any]] = {}
        self.notes: list[str] = []
        self.start = time.monotonic()
        self.stop_by: float | None = None  # when interrupted ranks must have answered
        self.died: list[Rank] = []
        self.extended = False  # the ranks were given GRACE once more (busy in Python, slow to stop)

    def pending(self) -> list[Rank]:
        return [r for r in self.targets if r.rank not in self.results and not r.gone]

    def run(self) -> dict[str, Any]:
        deadline = None if self.timeout is None else self.start + self.timeout + MARGIN
        while self.pending():
            now = time.monotonic()
            if deadline is not None and now >= deadline and self.stop_by is None:
                self._timed_out()
                continue
            if self.stop_by is not None and now >= self.stop_by:
                said = self._ask(self.pending())
                if not self.pending():  # the last ones answered meanwhile
                    continue
                if self._slow(said):  # busy in Python, not inside a call: only slow to stop (a loaded host)
                    self.stop_by = time.monotonic() + GRACE
                    continue
                return self._stuck(said)
            wake = [t for t in (deadline if self.stop_by is None else None, self.stop_by) if t is not None]
            self._pump(min(wake) - now if wake else None)
        return self._finish()

    def _pump(self, wait: float | None) -> None:
        socks = [self.host.front] + [r.sock for r in self.pending()]
        ready = select.select(socks, [], [], None if wait is None else max(0.0, wait))[0]
        for sock in ready:
            if sock is self.host.front:
                message = pickled.recv(sock)
                if message is None:  # the front end has gone
                    self.host.end()
                    os._exit(0)
                if message.get("op") == "interrupt" and self.stop_by is None:
                    self._interrupt(f"interrupted after {time.monotonic() - self.start:.1f} s")
                continue
            r = next(r for r in self.targets if r.sock is sock)
            self._read(r)

    def _read(self, r: Rank) -> None:
        message = pickled.recv(r.sock)
        if message is None:
            r.reap()
            self.died.append(r)
            if self.stop_by is None:  # the others get GRACE to finish (a lost peer's error, say)
                self.stop_by = time.monotonic() + GRACE
            return
        if "where" in message:
            r.where = message["where"]
        elif "interrupted" in message:  # a SIGINT of its own (a launcher's): every rank is interrupted
            if self.stop_by is None:
                self._interrupt(f"rank {r.rank} got SIGINT after {time.monotonic() - self.start:.1f} s: interrupted")
        else:
            self.results[r.rank] = message

    def _interrupt(self, why: str | None) -> None:
        for r in self.pending():
            try:
                pickled.send(r.sock, "interrupt")
            except OSError:
                pass
        self.stop_by = time.monotonic() + GRACE
        if why:
            self.notes.append(f"spmd: {why}")

    def _ask(self, ranks: list[Rank]) -> dict[int, dict[str, Any]]:
        for r in ranks:
            r.where = None
            try:
                pickled.send(r.sock, "where")
            except OSError:
                pass
        until = time.monotonic() + ASK
        while any(r.where is None and not r.gone for r in ranks) and time.monotonic() < until:
            ready = select.select([r.sock for r in ranks if not r.gone], [], [], until - time.monotonic())[0]
            for sock in ready:
                self._read(next(r for r in ranks if r.sock is sock))
        return {r.rank: r.where for r in ranks if r.where is not None}

    def _timed_out(self) -> None:
        from spmd.interactive.merge import where_report

        stuck = self.pending()
        done = sorted(self.results)
        said = self._ask(stuck)
        self.notes.append(where_report(said, [r.rank for r in stuck], done,
                                       f"the block did not finish within its timeout of {self.timeout:g} s"))
        self._interrupt(None)  # the report said why

    def _slow(self, said: dict[int, dict[str, Any]]) -> bool:
        """Whether the ranks still running get GRACE more: once, none inside a call, none dead."""
        if self.extended or self.died or not self.pending():
            return False
        self.extended = True
        return all(r.rank in said and not said[r.rank].get("call") for r in self.pending())

    def _stuck(self, said: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """Ranks that did not stop: say where they are, then start the world afresh."""
        from spmd.interactive.merge import where_report

        stuck = self.pending()
        if self.died:
            first = self.died[0]
            self.notes.append(where_report(said, [r.rank for r in stuck], sorted(self.results),
                                           f"rank {first.rank} {first.ended} and they had not "
                                           f"finished {GRACE:g} s later"))
            return self._ended()
        calls = sorted({w["call"] for w in said.values() if w.get("call")})
        inside = f" (inside {', '.join(calls)}: gloo and MPI cannot cancel a call in progress)" if calls else ""
        who = ranks_text([r.rank for r in stuck], ranges=True)
        reply = self.host.restart(f"{who} did not stop within {GRACE:g} s of the interrupt{inside}")
        self.notes.append(reply.get("note") or reply.get("error", ""))
        return self._reply()

    def _ended(self) -> dict[str, Any]:
        first = self.died[0]
        self.host.end()
        self.host.dead = f"the world has ended: rank {first.rank} {first.ended}"
        self.notes.append(f"spmd: {self.host.dead}; %restart starts {self.host.size} fresh ranks"
                          if self.host.can_restart else f"spmd: {self.host.dead}")
        return self._reply()

    def _finish(self) -> dict[str, Any]:
        if self.died:
            return self._ended()
        broken = sorted(r for r, res in self.results.items() if res.get("kind") in BROKEN)
        if broken:
            reply = self.host.restart(f"the communicator of {ranks_text(broken, ranges=True)} failed, so it cannot be "
                                      "trusted any more")
            self.notes.append(reply.get("note") or reply.get("error", ""))
        return self._reply()

    def _reply(self) -> dict[str, Any]:
        return {"results": self.results, "notes": self.notes, "ranks": [r.rank for r in self.targets],
                "fatal": self.host.fatal}
