"""One rank of a kept world, in a process the fork server forked for tests of one size.

``run`` starts this rank's own output capture, its place in the world
(spmd's variables, the store on the server's listening socket for rank 0)
and the global communicator, then runs the tests the server sends, one at
a time: each on a communicator split from the world, split afresh (the old
one freed) after a test that made a point-to-point call or a split on it,
so no message or group of one test reaches the next; with its own temporary
directory, pytest's setup, call and teardown, each phase's report sent as
it is made.  The server ends the world after any test that did not pass
on every rank, and at the end of the session; the rank leaves with
os._exit.  A thread answers the server's request for where this rank is
(spmd.failfast.report.where).  A rank starts a test's body only when the
server says every rank has its communicator ("ready", then "go"), so a
test that kills one rank at once cannot cut another's setup short.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, NoReturn

from spmd.failfast.report import where
from spmd.launch.supervise import child_env
from spmd.util import pickled
from spmd.testing.frames import hide_spmd_frames
from spmd.testing.tmp import share
from spmd.testing.marks import COMM

__all__ = ["run", "Ticket", "INTERNAL"]

#: The first line of what a rank writes to its crash file when spmd's own code here failed (exit status 70).
INTERNAL = "spmd's pytest rank failed in its own code (a bug of spmd's: please report it):"


class Ticket:
    """What a forked rank needs of the server: its place in the world, how it meets, its timeout."""

    def __init__(self, rank: int, size: int, port: int, listen_fd: int | None, backend: str,
                 timeout: float, base: Path) -> None:
        self.rank, self.size, self.port, self.listen_fd = rank, size, port, listen_fd
        self.backend, self.timeout, self.base = backend, timeout, base


class _Channel:
    """The rank's end of its socket to the server: reports out; tests, 'where' and 'leave' in."""

    def __init__(self, sock: socket.socket, rank: int) -> None:
        self.sock, self.rank, self.path = sock, rank, ""
        self._lock = threading.Lock()
        self.tests: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.go = threading.Event()  # the server's word that every rank of the test is ready
        self._monitors: list[Any] = []
        threading.Thread(target=self._answer, name="spmd-pytest-rank", daemon=True).start()

    def send(self, message: dict[str, Any]) -> None:
        with self._lock:
            pickled.send(self.sock, message)

    def watch(self, comm: Any) -> None:
        self._monitors = comm._mon.family

    def _answer(self) -> None:
        while True:
            request = pickled.recv(self.sock)
            if request is None:  # the server has gone: nothing to report to
                os._exit(70)
            if request == "leave":
                self.tests.put(None)
                return
            if request == "go":
                self.go.set()
            if request == "where":
                try:
                    self.send({"where": dict(where(self.rank, self._monitors), stack=self._stack())})
                except OSError:
                    pass
            elif isinstance(request, dict):
                self.tests.put(request)

    def _stack(self) -> str:
        """The main thread's stack from the test's own frames inward (pytest's outer frames left out)."""
        frame = sys._current_frames().get(threading.main_thread().ident)
        frames = traceback.extract_stack(frame) if frame is not None else []
        first = next((i for i, f in enumerate(frames) if f.filename == self.path), 0)
        return "".join(traceback.format_list(frames[first:]))


def _crash_file(ticket: Ticket) -> None:
    """Where this rank's fatal errors (a segfault's Python stack) go: a file the server reads."""
    import faulthandler

    crash = open(ticket.base / f".rank{ticket.rank}.crash", "w")
    faulthandler.enable(file=crash, all_threads=False)


def _own_capture(config: Any) -> None:
    """Capture this rank's output in files of its own (the server's were shared at the fork)."""
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None and capman.is_globally_capturing():
        capman.stop_global_capturing()
        capman.start_global_capturing()


def _start(ticket: Ticket) -> Any:
    import spmd.runtime.start as start_

    if start_.initialized():  # a world of one the collection started (module-level `comm.rank`)
        start_.finalize()
    return start_.init_watched(ticket.backend, ticket.timeout)


class _Rank:
    """This rank's world and the tests it runs on it."""

    def __init__(self, items: dict[str, Any], ticket: Ticket, channel: _Channel) -> None:
        self.items, self.ticket, self.channel = items, ticket, channel
        self.world: Any = None
        self.own: Any = None  # the tests' communicator, kept while no test leaves anything on it

    def report(self, item: Any, rep: Any) -> None:
        config = item.config
        self.channel.send({"when": rep.when,
                           "report": config.hook.pytest_report_to_serializable(config=config, report=rep)})

    def test(self, request: dict[str, Any]) -> None:
        from _pytest.runner import CallInfo, call_and_report

        item = self.items[request["test"]]
        following = self.items.get(request["next"]) if request.get("next") else None
        self.channel.path = str(item.path)
        self.channel.go.clear()
        prepared = CallInfo.from_call(lambda: self._prepare(request.get("fresh", True)), "setup")
        if prepared.excinfo is not None:  # no world or no communicator: a setup error of this rank
            self.report(item, item.ihook.pytest_runtest_makereport(item=item, call=prepared))
            return
        self.channel.send({"ready": True})
        self.channel.go.wait()
        own = prepared.result
        config = item.config
        state = item.session._setupstate
        try:
            state.teardown_exact(item)  # what an earlier test of another module left set up here
        except BaseException:
            pass
        undo = share(config, Path(request["base"]))
        config.stash[COMM] = own
        hide_spmd_frames(item)
        try:
            rep = call_and_report(item, "setup", log=False)
            self.report(item, rep)
            if rep.passed and not config.getoption("setuponly", False):
                self.report(item, call_and_report(item, "call", log=False))
            self.report(item, call_and_report(item, "teardown", log=False, nextitem=following))
        finally:
            del config.stash[COMM]
            undo()

    def _prepare(self, fresh: bool) -> Any:
        """The world (started for the first test) and the test's communicator."""
        if self.world is None:
            self.world = _start(self.ticket)
            self.channel.watch(self.world)
        return self._own(fresh)

    def _own(self, fresh: bool) -> Any:
        """The test's communicator: split afresh after a test that may have left a message or a group on it."""
        if fresh or self.own is None:
            if self.own is not None:
                self.own.free()
            clean = not self.world._mon.dirty
            self.own = self.world.split(0)
            self.world._mon.dirty = not clean  # our own split leaves nothing of the tests' behind
        self.own._mon.restart()  # the test's first call is call #1
        self.own._mon.dirty = False
        return self.own

    def dirty(self) -> dict[str, bool]:
        """What the server needs to know: may this test have left something on its or the world's communicator?"""
        return {"dirty": bool(self.own is None or self.own._mon.dirty),
                "world_dirty": bool(self.world is None or self.world._mon.dirty)}

    def leave(self) -> None:
        """At the session's end: tear down what is still set up (best effort: nobody to report to)."""
        for item in list(self.items.values())[:1]:
            try:
                item.session._setupstate.teardown_exact(None)
            except BaseException:
                pass


def run(items: dict[str, Any], config: Any, ticket: Ticket, sock: socket.socket) -> NoReturn:
    """Be one rank of a kept world: run the tests the server sends until it says leave (never returns)."""
    code = 0
    try:
        _own_capture(config)
        env = child_env(ticket.rank, ticket.size, port=ticket.port, listen_fd=ticket.listen_fd,
                        backend=ticket.backend, timeout=ticket.timeout, prefixed=True)
        os.environ.clear()
        os.environ.update(env)
        _crash_file(ticket)
        channel = _Channel(sock, ticket.rank)
        me = _Rank(items, ticket, channel)
        while (request := channel.tests.get()) is not None:
            me.test(request)
            channel.send({"done": True, **me.dirty()})
        me.leave()
    except BaseException:  # spmd's own failure here: the server reports the status and this text
        try:
            with open(ticket.base / f".rank{ticket.rank}.crash", "a") as crash:
                crash.write(f"{INTERNAL}\n" + traceback.format_exc())
        except Exception:
            pass
        code = 70
    os._exit(code)
