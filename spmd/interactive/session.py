"""The front end's side of an interactive session: a world of ranks to run blocks on, from Python.

``Session(4)`` starts the host (spmd.interactive.host) in a session of
its own, which imports torch once and forks the 4 ranks; ``run`` sends a
block and waits for its merged reply.  A Ctrl-C (SIGINT: the terminal's,
or a notebook's interrupt) while it waits is passed to the ranks as an
interrupt, and the wait goes on until the host has stopped them.  The
REPL (spmd.interactive.console) and the magic (spmd.interactive.magic) are
thin front ends over this class; docs/interactive.md is the reference.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from spmd.errors import SessionError
from spmd.interactive.merge import render
from spmd.util import pickled
from spmd.util.words import span

__all__ = ["Session"]


class Session:
    """n ranks on this machine, each with a namespace that holds ``comm`` and ``spmd``.

    backend: "gloo" (default) or "mpi"; timeout: seconds a block may run
    before spmd reports where every rank is and interrupts it (None: no
    limit, Ctrl-C stops it; the collectives keep their own, SPMD_TIMEOUT);
    preload: modules the host imports once for every rank (torch and numpy
    always are), so that restarts skip them too.
    """

    def __init__(self, n: int, backend: str | None = None, timeout: float | None = None,
                 preload: list[str] | None = None) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SessionError(f"a session needs a number of ranks >= 1, got {n!r}")
        if backend not in (None, "gloo", "mpi"):
            raise SessionError(f"an interactive session runs on gloo or mpi, not {backend!r}")
        self.size, self.backend, self.timeout = n, backend, _seconds(timeout)
        self._send_lock = threading.Lock()
        self.interrupts = 0  # how many interrupts were sent (a front end starts a new line after one)
        self._preload = list(preload or ())
        self._proc: subprocess.Popen[bytes] | None = None
        began = time.monotonic()
        self._start()
        self.started_in = time.monotonic() - began  # the host's start (its imports) and the world's

    def _start(self) -> None:
        if self.backend == "mpi":  # MPI's ranks need MPI's launcher: spmd.interactive.mpi
            from spmd.interactive.mpi import launch

            self._proc, self._sock = launch(self.size)
        else:
            self._sock, theirs = pickled.pair()
            config = {"size": self.size, "backend": self.backend, "preload": self._preload}
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "spmd.interactive.host", str(theirs.fileno()), json.dumps(config)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
            theirs.close()
        reply = self._wait()
        if "error" in reply:
            self.stop()
            raise SessionError(reply["error"].removeprefix("spmd: "))

    @classmethod
    def attached(cls, sock: Any, size: int, timeout: float | None = None) -> Session:
        """A session on a host that already serves on sock (a launched world's, spmd.interactive.launched)."""
        self = cls.__new__(cls)
        self.size, self.backend, self.timeout = size, None, _seconds(timeout)
        self._sock, self._send_lock, self.interrupts, self._proc = sock, threading.Lock(), 0, None
        reply = self._wait()
        if "error" in reply:
            raise SessionError(reply["error"].removeprefix("spmd: "))
        self.started_in = float(reply["seconds"])
        return self

    # -- waiting for the host --------------------------------------------------------

    def _wait(self) -> dict[str, Any]:
        """The host's next reply; a Ctrl-C meanwhile becomes an interrupt of the ranks, and the wait goes on."""
        while True:
            try:
                select.select([self._sock], [], [])
                reply = pickled.recv(self._sock)
            except KeyboardInterrupt:
                self.interrupt()
                continue
            if reply is None:
                status = None if self._proc is None else self._proc.poll()
                how = f"status {status}" if status is not None else "its socket closed"
                raise SessionError(f"the session's host has ended ({how}); start a new session")
            return reply

    def interrupt(self) -> None:
        """Interrupt the running block on every rank (from any thread; a Ctrl-C during run does this)."""
        self.interrupts += 1
        try:
            with self._send_lock:
                pickled.send(self._sock, {"op": "interrupt"})
        except OSError:
            pass

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        if not self.alive:
            raise SessionError("the session has been stopped; start a new one")
        with self._send_lock:
            pickled.send(self._sock, request)
        return self._wait()

    # -- what a front end does -------------------------------------------------------

    def run(self, code: str, ranks: list[int] | None = None, timeout: float | None = None,
            rich: bool = False) -> dict[str, Any]:
        """Run code on every rank (or ranks); return the host's reply: results by rank, spmd's notes."""
        ranks = self._ranks(ranks)
        limit = self.timeout if timeout is None else _seconds(timeout)
        reply = self._ask({"op": "run", "code": code, "ranks": ranks, "timeout": limit, "rich": rich})
        if reply.get("fatal") and self.backend == "mpi":  # a launched world that cannot go on: a new job
            seconds = self.restart()
            reply["notes"].append(f"spmd: mpirun started {self.size} fresh ranks in {seconds:.1f} s; every "
                                  "rank's variables are gone")
            reply["fatal"] = False
        return reply

    def text(self, code: str, ranks: list[int] | None = None, timeout: float | None = None) -> str:
        """Run code and return what the ranks said, merged (spmd.interactive.merge.render)."""
        return render(self.run(code, ranks, timeout))

    def pull(self, name: str, ranks: list[int] | None = None) -> list[Any]:
        """The value of name on every rank (or ranks), in rank order."""
        reply = self._ask({"op": "pull", "name": name, "ranks": self._ranks(ranks)})
        if reply.get("error"):
            raise SessionError(reply["error"].removeprefix("spmd: "))
        if reply["errors"]:
            first = min(reply["errors"])
            raise SessionError(f"cannot pull {name!r} from rank(s) {span(reply['errors'])}: "
                               f"{reply['errors'][first]}")
        return [pickle.loads(reply["values"][r]) for r in sorted(reply["values"])]

    def push(self, values: dict[str, Any], ranks: list[int] | None = None) -> None:
        """Set names to values in every rank's (or ranks') namespace."""
        try:
            data = pickle.dumps(dict(values), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise SessionError(f"cannot send {sorted(values)} to the ranks: {type(exc).__name__}: {exc}") from None
        reply = self._ask({"op": "push", "values": data, "ranks": self._ranks(ranks)})
        if reply.get("error"):
            raise SessionError(reply["error"].removeprefix("spmd: "))

    def restart(self) -> float:
        """End the ranks and start as many fresh ones; return the seconds it took."""
        if self.backend == "mpi":  # a new mpirun job
            began = time.monotonic()
            self.stop()
            self._start()
            return time.monotonic() - began
        reply = self._ask({"op": "restart"})
        if "error" in reply:
            raise SessionError(reply["error"].removeprefix("spmd: "))
        return float(reply["seconds"])

    def stop(self) -> None:
        """End the ranks and the host (nothing is left running)."""
        if self._proc is None:  # an attached host ends its ranks when told, then this end closes
            if self._sock.fileno() >= 0:
                try:
                    pickled.send(self._sock, {"op": "stop"})
                except OSError:
                    pass
        elif self._proc.poll() is None:
            try:
                pickled.send(self._sock, {"op": "stop"})
            except OSError:
                pass
            try:
                self._proc.wait(timeout=5 if self.backend != "mpi" else 15)
            except subprocess.TimeoutExpired:
                _kill(self._proc)
                self._proc.wait()
        self._sock.close()

    @property
    def alive(self) -> bool:
        if self._proc is None:
            return self._sock.fileno() >= 0
        return self._proc.poll() is None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _ranks(self, ranks: list[int] | None) -> list[int] | None:
        if ranks is None:
            return None
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.size]
        if bad or not ranks:
            raise SessionError(f"ranks {ranks!r}: give ranks between 0 and {self.size - 1}")
        return sorted(set(ranks))


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill the host, or mpirun's whole session (the host's ranks die with it by their death signal)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _seconds(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise SessionError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    return float(timeout)
