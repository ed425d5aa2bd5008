"""One rank of a marked test, in a process the fork server has just forked.

``run`` starts this rank's own output capture, its place in the test's
world (spmd's variables, the store on the server's listening socket for
rank 0), the global communicator, then pytest's setup, call and teardown
of the test, sending each phase's report to the server as it is made.
It then waits for the server's word to leave, and leaves with os._exit:
the server ends every rank of a test together, so no rank's exit is
taken by a peer for a death.  A thread answers the server's request for
where this rank is (spmd.failfast.report.where).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, NoReturn

from spmd.failfast.report import where
from spmd.launch.supervise import child_env
from spmd.testing import wire
from spmd.testing.frames import hide_spmd_frames
from spmd.testing.tmp import share
from spmd.testing.marks import COMM

__all__ = ["run", "Ticket"]


class Ticket:
    """What a forked rank needs of the server: its place, the test's world, where to report."""

    def __init__(self, rank: int, size: int, port: int, listen_fd: int | None, backend: str,
                 timeout: float, base: Path) -> None:
        self.rank, self.size, self.port, self.listen_fd = rank, size, port, listen_fd
        self.backend, self.timeout, self.base = backend, timeout, base


class _Channel:
    """The rank's end of its socket to the server: reports out, the server's requests in."""

    def __init__(self, sock: socket.socket, rank: int, path: str) -> None:
        self.sock, self.rank, self.path = sock, rank, path
        self._lock = threading.Lock()
        self._leave = threading.Event()
        self._monitors: list[Any] = []
        threading.Thread(target=self._answer, name="spmd-pytest-rank", daemon=True).start()

    def send(self, message: dict[str, Any]) -> None:
        with self._lock:
            wire.send(self.sock, message)

    def watch(self, comm: Any) -> None:
        self._monitors = comm._mon.family

    def _answer(self) -> None:
        while True:
            request = wire.recv(self.sock)
            if request is None or request == "leave":
                self._leave.set()
                if request is None:  # the server has gone: nothing to report to
                    os._exit(70)
                return
            if request == "where":
                try:
                    self.send({"where": dict(where(self.rank, self._monitors), stack=self._stack())})
                except OSError:
                    pass

    def _stack(self) -> str:
        """The main thread's stack from the test's own frames inward (pytest's outer frames left out)."""
        frame = sys._current_frames().get(threading.main_thread().ident)
        frames = traceback.extract_stack(frame) if frame is not None else []
        first = next((i for i, f in enumerate(frames) if f.filename == self.path), 0)
        return "".join(traceback.format_list(frames[first:]))

    def wait_to_leave(self) -> None:
        self._leave.wait()


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


def _phases(item: Any, channel: _Channel, ticket: Ticket) -> None:
    from _pytest.runner import CallInfo, call_and_report

    config = item.config
    hook = config.hook

    def report(rep: Any) -> None:
        channel.send({"when": rep.when, "report": hook.pytest_report_to_serializable(config=config, report=rep)})

    def start() -> Any:
        import spmd.runtime.start as start_

        if start_.initialized():  # a world of one the collection started (module-level `comm.rank`)
            start_.finalize()
        return start_.init_watched(ticket.backend, ticket.timeout)

    started = CallInfo.from_call(start, "setup")
    if started.excinfo is not None:  # the world did not start: a setup error of this rank
        report(item.ihook.pytest_runtest_makereport(item=item, call=started))
        return
    comm = started.result
    channel.watch(comm)
    config.stash[COMM] = comm
    rep = call_and_report(item, "setup", log=False)
    report(rep)
    if rep.passed and not config.getoption("setuponly", False):
        report(call_and_report(item, "call", log=False))
    report(call_and_report(item, "teardown", log=False, nextitem=None))


def run(item: Any, ticket: Ticket, sock: socket.socket) -> NoReturn:
    """Be one rank of item's test, then leave when the server says (never returns)."""
    code = 0
    try:
        config = item.config
        _own_capture(config)
        env = child_env(ticket.rank, ticket.size, port=ticket.port, listen_fd=ticket.listen_fd,
                        backend=ticket.backend, timeout=ticket.timeout, prefixed=True)
        os.environ.clear()
        os.environ.update(env)
        share(config, ticket.base)
        _crash_file(ticket)
        hide_spmd_frames(item)
        channel = _Channel(sock, ticket.rank, str(item.path))
        _phases(item, channel, ticket)
        channel.send({"done": True})
        channel.wait_to_leave()
    except BaseException:  # spmd's own failure here: the server reports the status and this text
        try:
            sys.__stderr__.write(f"spmd pytest rank {ticket.rank}: internal error\n" + traceback.format_exc())
            sys.__stderr__.flush()
        except Exception:
            pass
        code = 70
    os._exit(code)
