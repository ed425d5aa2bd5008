"""The launcher's end of a fork server: ``ForkServer`` starts it and forks ranks from it.

Each rank is a ``Forked``, which has the ``subprocess.Popen`` methods that
spmd.launch.supervise uses, so forked and spawned ranks are supervised by
the same code.  docs/preload.md ("Design") is the reference.  Only the
standard library is imported.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import BinaryIO, Callable, Collection, Iterable, Mapping

from spmd.errors import LaunchError
from spmd.launch.forkserver.protocol import recv, send
from spmd.util.paths import FORK_SERVER

__all__ = ["ForkServer", "Forked", "parse_modules"]


def parse_modules(text: str) -> list[str]:
    """Return the module names of a comma-separated list; LaunchError for a name that is not one."""
    names = [part.strip() for part in text.split(",")]
    names = [n for n in names if n]
    if not names:
        raise LaunchError(f"--preload {text!r} names no module: give a comma-separated list, e.g. torch,numpy")
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise LaunchError(f"--preload: {name!r} is not a module name (e.g. torch, numpy, torch.distributed)")
    return list(dict.fromkeys(names))


class Forked:
    """A rank forked by the server, as the launcher's supervision sees a subprocess.Popen."""

    def __init__(self, server: ForkServer, rank: int, pid: int, stdout: BinaryIO | None = None,
                 stderr: BinaryIO | None = None) -> None:
        self._server, self.rank, self.pid = server, rank, pid
        self.stdout, self.stderr = stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Return the exit status if the rank has ended (as Popen: -N for signal N), else None."""
        if self.returncode is None:
            self._server.collect(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the rank to end and return its status; subprocess.TimeoutExpired after timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"rank {self.rank}", timeout)
            self._server.collect(left)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Send signum to the rank, unless it has ended."""
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's end of a fork server: start it, fork ranks from it, learn how they end.

    env: the server's environment (what every rank's environment shares);
    piped: give the server pipes for stdout and stderr (as the ranks get
    when the launcher prefixes their lines), to read as proc.stdout and
    proc.stderr.  sock: a connection to a server that already serves
    (a kept one's session, spmd.launch.forkserver.kept): nothing is started, and
    proc is None.
    """

    def __init__(self, modules: Iterable[str], env: Mapping[str, str], *, piped: bool = False,
                 preexec_fn: Callable[[], None] | None = None, sock: socket.socket | None = None) -> None:
        self.modules = list(modules)
        if sock is not None:
            self._setup(env, sock)
            self._served, self.proc = True, None
            return
        if not hasattr(os, "fork") or os.name != "posix":
            raise LaunchError(f"--preload needs os.fork, which {sys.platform} lacks: run without --preload")
        try:
            self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except (AttributeError, OSError) as e:
            raise LaunchError(f"--preload needs AF_UNIX SOCK_SEQPACKET sockets (Linux), not available "
                              f"here ({e}): run without --preload") from None
        self._setup(env, self._sock)
        pipe = subprocess.PIPE if piped else None
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", FORK_SERVER, str(theirs.fileno()), ",".join(self.modules)],
                env=self._env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                stdout=pipe, stderr=pipe, start_new_session=True, preexec_fn=preexec_fn)
        finally:
            theirs.close()

    def _setup(self, env, sock):
        self._sock = sock
        self._env = dict(env)
        self._ranks = {}  # rank -> Forked
        self._pending = {}  # rank -> pid reply, exit before the Forked exists
        self._served = False  # the server finished its imports and serves
        self._gone = False  # the server's end of the socket is closed: it has ended
        self._devnull = None

    def ready(self, stop: Collection[object] = ()) -> bool:
        """Wait for the server's imports; return True, or False if stop filled first; LaunchError if refused."""
        if self._served:
            return True
        while not stop:
            if select.select([self._sock], [], [], 0.05)[0]:
                message, fds = recv(self._sock)
                for fd in fds:
                    os.close(fd)
                if message is None:
                    code = self.proc.wait()
                    raise LaunchError(f"spmd run --preload: the fork server exited (status {code}) while "
                                      f"importing {','.join(self.modules)}; see its output above, or run "
                                      "without --preload")
                if "error" in message:
                    raise LaunchError(message["error"])
                self._served = True
                return True
        return False

    def spawn(self, rank: int, argv: Iterable[str], env: Mapping[str, str], *, stdin_fd: int | None = None,
              pipes: bool = False, listen: socket.socket | None = None) -> Forked:
        """Fork rank from the server with environment env; return its Forked.

        stdin_fd: the rank's stdin (None: /dev/null); pipes: its stdout and
        stderr are new pipes, read through Forked.stdout and .stderr (else
        the launcher's own); listen: the socket SPMD_LISTEN_FD names.
        """
        if stdin_fd is None:
            if self._devnull is None:
                self._devnull = os.open(os.devnull, os.O_RDONLY)
            stdin_fd = self._devnull
        ours, theirs = [], [stdin_fd]
        if pipes:
            for _ in range(2):
                r, w = os.pipe()
                ours.append(r)
                theirs.append(w)
        else:
            theirs += [1, 2]
        if listen is not None:
            theirs.append(listen.fileno())
        request = {
            "rank": rank, "argv": list(argv),
            "set": {k: v for k, v in env.items() if self._env.get(k) != v},
            "unset": [k for k in self._env if k not in env],
        }
        try:
            send(self._sock, request, theirs)
        except (BrokenPipeError, ConnectionResetError):  # it has ended: collect finds so
            pass
        except OSError as e:  # e.g. an environment too large for one message
            raise LaunchError(f"spmd run --preload: cannot send rank {rank}'s request to the fork "
                              f"server ({e}): run without --preload") from None
        finally:
            if pipes:
                for fd in theirs[1:3]:
                    os.close(fd)
        while rank not in self._pending and not self._gone:
            self.collect(None)
        reply = self._pending.pop(rank, None)
        if reply is None or "error" in reply:
            for fd in ours:
                os.close(fd)
            why = "the fork server ended" if reply is None else reply["error"]
            raise LaunchError(f"spmd run --preload: cannot start rank {rank}: {why}")
        outs = [open(fd, "rb") for fd in ours] or [None, None]
        forked = Forked(self, rank, reply["pid"], *outs)
        self._ranks[rank] = forked
        if "exit" in reply:
            forked.returncode = reply["exit"]
        return forked

    def collect(self, timeout: float | None) -> None:
        """Read the server's messages for up to timeout seconds (None: until one comes); 0: only what is there."""
        if self._gone:
            return
        ready = select.select([self._sock], [], [], timeout)[0]
        while ready:
            message, fds = recv(self._sock)
            for fd in fds:
                os.close(fd)
            if message is None:
                self._lost()
                return
            rank = message["rank"]
            if "exit" in message and rank in self._ranks:
                self._ranks[rank].returncode = message["exit"]
            else:
                self._pending.setdefault(rank, {}).update(message)
            ready = select.select([self._sock], [], [], 0)[0]

    def _lost(self):
        """The server is gone: its ranks died of their death signal (SIGKILL) with it."""
        self._gone = True
        for forked in self._ranks.values():
            if forked.returncode is None:
                forked.returncode = -signal.SIGKILL

    def done(self) -> None:
        """Tell the server that no more ranks come: it then only waits for them and reports."""
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        """End the server (it ends by itself once its ranks have) and free what is left.

        A kept server's session (proc None) ends by itself when this end closes.
        """
        self.done()
        if self.proc is not None:
            if self.proc.poll() is None and self._served:
                try:
                    self.proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
        self._sock.close()
        if self._devnull is not None:
            os.close(self._devnull)
            self._devnull = None
