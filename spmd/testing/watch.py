"""The fork server's side of the tests: kept worlds of forked ranks, one per size, and one test on one.

A ``World`` of n ranks, forked for the first test of n ranks (and that
timeout), runs the next ones of that size while each passes on every rank;
one that does not ends it, and the next gets fresh ranks; the body starts
once every rank said it has its communicator.  What ends a test
(docs/testing-your-code.md, "Faults"):

- every rank has sent its reports: the test is over;
- a rank failed a phase or died: the others get GRACE seconds to finish
  by themselves, then those still running are asked where they are and
  stopped (SIGKILL), so an exception on one rank while the others wait in
  a collective fails the test in seconds, not at its timeout;
- the test's timeout (plus MARGIN, so that spmd's own collective timeout,
  which names the call every rank waits in, is heard first): every rank
  still running is asked where it is and stopped.
"""

from __future__ import annotations

import gc
import os
import selectors
import signal
import socket
import time
from pathlib import Path
from typing import Any

from spmd.launch.forkserver.process import die_with, flush_std
from spmd.runtime import secret as job_secret
from spmd.testing import rank as rank_
from spmd.util import pickled
from spmd.util.words import exit_text, ranks_text

__all__ = ["World", "GRACE", "MARGIN", "ASK"]

#: Seconds the other ranks get to finish after one rank failed or died.
GRACE = 2.0
#: Seconds past the test's timeout before the server stops its ranks.
MARGIN = 1.0
#: Seconds ranks get to say where they are before they are stopped.
ASK = 1.0

_PHASES = ("setup", "call", "teardown")


class _Rank:
    """What the server knows of one forked rank."""

    def __init__(self, rank: int, pid: int, sock: socket.socket) -> None:
        self.rank, self.pid, self.sock = rank, pid, sock
        self.reports: list[dict[str, Any]] = []
        self.finished = False  # sent every report and waits to leave
        self.ready = False  # has its communicator and waits for the word to start the test's body
        self.gone = False  # its socket closed: exited or killed
        self.status: int | None = None  # os.waitstatus_to_exitcode, once reaped
        self.where: dict[str, Any] | None = None
        self.stopped: str | None = None  # why the server stopped it

    @property
    def phase(self) -> str:
        """The phase this rank is in (or was in when it ended)."""
        done = [r["when"] for r in self.reports]
        if any(r.get("outcome") != "passed" for r in self.reports if r["when"] == "setup"):
            return "teardown"
        for when in _PHASES:
            if when not in done:
                return when
        return "teardown"

    def failed(self) -> bool:
        return any(r.get("outcome") == "failed" for r in self.reports)

    def next_test(self) -> None:
        self.reports, self.finished, self.where, self.stopped, self.ready = [], False, None, None, False
        self.dirty = self.world_dirty = True  # until the rank says otherwise


def _fork(items: dict[str, Any], config: Any, size: int, backend: str, timeout: float, base: Path,
          close: list[socket.socket]) -> list[_Rank]:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))  # the store of rank 0 accepts on it: loopback only
    listener.listen(4 * size)
    port = listener.getsockname()[1]
    server = os.getpid()
    ranks: list[_Rank] = []
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture()
    flush_std()
    gc.freeze()  # what collection made: never copied by a rank's collections
    os.environ[job_secret.ENV] = job_secret.new().decode()  # this world's, for its store (child_env keeps it)
    try:
        for r in range(size):
            mine, theirs = pickled.pair()
            pid = os.fork()
            if pid == 0:
                mine.close()
                for s in close + [rk.sock for rk in ranks]:
                    s.close()
                if r != 0:
                    listener.close()
                die_with(server)
                ticket = rank_.Ticket(r, size, port, listener.fileno() if r == 0 else None, backend, timeout, base)
                rank_.run(items, config, ticket, theirs)
            theirs.close()
            ranks.append(_Rank(r, pid, mine))
    finally:
        listener.close()
        gc.unfreeze()
        if capman is not None:
            capman.resume_global_capture()
    return ranks


def _reap(r: _Rank) -> None:
    _, status = os.waitpid(r.pid, 0)
    r.status = os.waitstatus_to_exitcode(status)


class _Watch:
    def __init__(self, ranks: list[_Rank], timeout: float) -> None:
        self.ranks, self.timeout = ranks, timeout
        self.sel = selectors.DefaultSelector()
        for r in ranks:
            if not r.gone:
                self.sel.register(r.sock, selectors.EVENT_READ, r)
        self.first_failure: float | None = None
        self.started = False  # whether the ranks were told to start the test's body
        self.why: str | None = None
        self.stacks: str | None = None

    def _read(self, r: _Rank, now: float) -> None:
        message = pickled.recv(r.sock)
        if message is None:
            r.gone = True
            self.sel.unregister(r.sock)
            r.sock.close()
            _reap(r)
            if not r.finished and r.stopped is None and self.first_failure is None:
                self.first_failure = now
            self._start_if_ready()
            return
        if "report" in message:
            r.reports.append(message["report"])
            if message["report"].get("outcome") == "failed" and self.first_failure is None:
                self.first_failure = now
        elif "done" in message:
            r.finished = True
            r.dirty, r.world_dirty = message.get("dirty", True), message.get("world_dirty", True)
        elif "where" in message:
            r.where = message["where"]
        elif "ready" in message:
            r.ready = True
        self._start_if_ready()

    def _start_if_ready(self) -> None:
        """Once every rank is ready (or has ended), tell the ready ones to start the test's body."""
        if self.started or not all(r.ready or r.gone or r.finished for r in self.ranks):
            return
        self.started = True
        for r in self.ranks:
            if r.ready and not r.gone:
                try:
                    pickled.send(r.sock, "go")
                except OSError:
                    pass

    def _pump(self, until: float) -> None:
        now = time.monotonic()
        for key, _ in self.sel.select(timeout=max(0.0, until - now)):
            self._read(key.data, time.monotonic())

    def _stop(self, ranks: list[_Rank], why: str) -> None:
        """Ask ranks where they are, then end them."""
        for r in ranks:
            try:
                pickled.send(r.sock, "where")
            except OSError:
                pass
        deadline = time.monotonic() + ASK
        while time.monotonic() < deadline and any(r.where is None and not r.gone for r in ranks):
            self._pump(deadline)
        for r in ranks:
            if not r.gone:
                r.stopped = why
                try:
                    os.kill(r.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.stacks = _stacks([r for r in self.ranks if r.stopped])

    def run(self, start: float) -> None:
        deadline = start + self.timeout + MARGIN
        try:
            self._run(deadline)
        finally:
            self.sel.close()

    def _run(self, deadline: float) -> None:
        while True:
            running = [r for r in self.ranks if not r.gone and not r.finished and r.stopped is None]
            if not running:
                return
            now = time.monotonic()
            if running and now >= deadline:
                self.why = f"the test did not finish within its timeout of {self.timeout:g} s"
                self._stop(running, self.why)
                continue
            if running and self.first_failure is not None and now >= self.first_failure + GRACE:
                failed = [r.rank for r in self.ranks if r.failed() or (r.gone and not r.finished)]
                who = ranks_text(failed) if failed else "a rank"
                self.why = f"{who} failed and it had not finished {GRACE:g} s later"
                self._stop(running, self.why)
                continue
            wake = deadline if self.first_failure is None else min(deadline, self.first_failure + GRACE)
            self._pump(wake)


def _stacks(stopped: list[_Rank]) -> str | None:
    """Each stopped rank's stack from the test's frames inward, identical ones once."""
    seen: dict[str, list[int]] = {}
    for r in stopped:
        if r.where and r.where.get("stack"):
            seen.setdefault(r.where["stack"], []).append(r.rank)
    if not seen:
        return None
    parts = []
    for stack, ranks in seen.items():
        parts.append(f"where {ranks_text(ranks)} stood when stopped (innermost last):\n{stack.rstrip()}")
    return "\n".join(parts)


def _ending(r: _Rank) -> str | None:
    """How a rank that did not finish ended, in words; None for one that finished."""
    if r.finished and not r.stopped:
        return None
    during = f"during the {r.phase}"
    if r.stopped:
        place = " (it did not say where it was)"
        if r.where:
            call = r.where.get("call")
            place = f", waiting in {call} at " if call else ", at "
            place += f"{r.where.get('where', '?')}" + ("" if call else f" in {r.where.get('func', '?')}()")
        return f"was stopped {during}{place}: {r.stopped}"
    if r.status is None:
        return f"ended {during} without an exit status"
    return f"{exit_text(r.status)} {during}"


def _crash_text(base: Path, rank: int) -> str:
    """A dead rank's fatal error and its stack from the test's file inward, if it wrote one."""
    try:
        text = (base / f".rank{rank}.crash").read_text()
    except OSError:
        return ""
    if rank_.INTERNAL in text:
        return text[text.index(rank_.INTERNAL):].rstrip()
    lines = text.splitlines()
    head = [ln for ln in lines[:1] if ln.startswith("Fatal Python error")]
    try:
        start = next(i for i, ln in enumerate(lines) if ln.startswith(("Current thread", "Stack (")))
    except StopIteration:
        return "\n".join(head)
    stack = []
    for ln in lines[start + 1:]:
        if not ln.startswith("  File"):
            break
        stack.append(ln)
        if "/_pytest/" in ln or "/pluggy/" in ln:
            stack.pop()
            break
    return "\n".join(head + ([lines[start]] + stack if stack else []))


class World:
    """size ranks forked once, meeting once, running the tests of that size one after another."""

    def __init__(self, items: dict[str, Any], config: Any, size: int, backend: str, timeout: float,
                 base: Path, close: list[socket.socket]) -> None:
        base.mkdir(parents=True, exist_ok=True)
        self.size, self.timeout, self.base = size, timeout, base
        self.ranks = _fork(items, config, size, backend, timeout, base, close)
        self.fresh = True  # whether the next test needs a communicator split afresh

    def alive(self) -> bool:
        """Whether every rank is still there (none died between tests)."""
        import select

        for r in self.ranks:
            if r.gone or select.select([r.sock], [], [], 0)[0]:  # readable between tests: closed
                return False
        return True

    def run(self, nodeid: str, following: str | None, base: Path) -> tuple[dict[str, Any], bool]:
        """Run one test; return (every rank's reports and how each that did not finish ended, healthy)."""
        start = time.monotonic()
        for r in self.ranks:
            r.next_test()
            try:
                pickled.send(r.sock, {"test": nodeid, "next": following, "base": str(base), "fresh": self.fresh})
            except OSError:
                pass
        watch = _Watch(self.ranks, self.timeout)
        watch.run(start)
        endings = {}
        for r in self.ranks:
            text = _ending(r)
            if text is not None:
                crash = _crash_text(self.base, r.rank) if not r.stopped else ""
                endings[r.rank] = {"phase": r.phase, "text": text + ("\n" + crash if crash else "")}
        # A world whose own communicator a test used for point to point may hold its messages: not kept.
        healthy = not endings and not any(r.failed() or r.world_dirty for r in self.ranks)
        self.fresh = any(r.dirty for r in self.ranks)
        result = {"size": self.size, "reports": {r.rank: r.reports for r in self.ranks}, "endings": endings,
                  "why": watch.why, "stacks": watch.stacks}
        return result, healthy

    @staticmethod
    def _reap_one(r: _Rank) -> None:
        try:
            os.kill(r.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def end(self) -> None:
        """Tell every rank to leave; kill those still there a moment later; reap them all."""
        for r in self.ranks:
            if not r.gone:
                try:
                    pickled.send(r.sock, "leave")
                except OSError:
                    pass
        deadline = time.monotonic() + 2.0
        for r in self.ranks:
            if r.gone:
                continue
            while time.monotonic() < deadline:
                done, status = os.waitpid(r.pid, os.WNOHANG)
                if done:
                    r.status, r.gone = os.waitstatus_to_exitcode(status), True
                    break
                time.sleep(0.005)
            if not r.gone:
                self._reap_one(r)
                _reap(r)
                r.gone = True
            r.sock.close()
