"""The fork server of ``spmd run --preload``: ``python -m spmd.launch.forkserver.forker FD MODULES``.

It imports MODULES in its only thread, checks that forking is safe
(spmd.launch.forkserver.safety), tells the launcher it is ready on the
socket FD, then forks a rank per request and reports each rank's pid and
exit status (``serve``).  A forked rank leaves the server's frames and runs
its script with ``spmd.runtime.runner.run_script``.  docs/preload.md ("What
a forked rank is", "The protocol") is the reference.
"""

from __future__ import annotations

import gc
import os
import socket
import sys

from spmd.launch.forkserver.process import die_with, end_now, flush_std, record_preloaded
from spmd.launch.forkserver.protocol import hung_up, recv, send, tell
from spmd.launch.forkserver.safety import load

__all__ = ["serve", "main", "run_rank", "WATCH_POLL", "TORCH_FIXED_SEED"]

#: torch's historical fixed default seed: a build that starts every process with it is not reseeded.
TORCH_FIXED_SEED = 67280421310721
#: Seconds between a watching server's checks that its launcher is still there (serve's watch).
WATCH_POLL = 0.01


def serve(sock: socket.socket, watch: bool = False) -> list[str] | None:
    """Fork a rank for each request and report how each ends.

    Returns None in the server once every rank has ended; in a forked rank
    returns its argv for run_script (the rank leaves the server's frames
    first, so none of their cleanup runs in it).  watch: also return None
    as soon as the launcher has gone (its end of sock closed, which a
    shutdown of its writing side after the last request is not), for a
    server whose death is not tied to the launcher's by a death signal
    (a kept server's session): the ranks then die with it.
    """
    server = os.getpid()
    ranks = {}  # pid -> rank
    requests = True
    while requests or ranks:
        if requests:
            message, fds = recv(sock)
            if message is None:  # the launcher has sent every request
                requests = False
                continue
            rank = message["rank"]
            flush_std()
            gc.freeze()  # what the imports made: never traversed by a rank's collections, nor copied by them
            try:
                pid = os.fork()
            except OSError as e:
                for fd in fds:
                    os.close(fd)
                tell(sock, {"rank": rank, "error": f"fork failed: {e}"})
                continue
            if pid == 0:
                return _become(sock, message, fds, server)
            for fd in fds:
                os.close(fd)
            ranks[pid] = rank
            tell(sock, {"rank": rank, "pid": pid})
            flags = os.WNOHANG  # more requests may come: report what has ended, without waiting
        else:
            flags = 0
        while ranks:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG if watch else flags)
            except ChildProcessError:
                ranks.clear()
                break
            if pid == 0:
                if flags or not watch:
                    break
                if hung_up(sock, WATCH_POLL):
                    return None
                continue
            if pid in ranks:
                tell(sock, {"rank": ranks.pop(pid), "exit": os.waitstatus_to_exitcode(status)})
            if not flags:  # one at a time while nothing else is to be done
                break
    return None


def _become(sock, message, fds, server):
    """In a freshly forked child: become the rank message describes; return its argv for run_script."""
    os.setsid()
    die_with(server)
    stdin, stdout, stderr, *rest = fds
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)  # inheritable, as a spawned rank's are
    for fd in (stdin, stdout, stderr):
        if fd > 2:
            os.close(fd)
    sock.close()
    for name in message["unset"]:
        os.environ.pop(name, None)
    os.environ.update(message["set"])
    if rest:  # rank 0's listening socket: under the launcher's number if free here, else its own
        os.environ["SPMD_LISTEN_FD"] = str(_renumber(rest[0], os.environ.get("SPMD_LISTEN_FD")))
    _reseed()
    return message["argv"]


def _renumber(fd, wanted):
    """Move fd to the number wanted (text) if that number is free; return fd's number, inheritable."""
    try:
        target = int(wanted)
        if target > 2 and target != fd:
            try:
                os.fstat(target)
            except OSError:  # free
                os.dup2(fd, target)
                os.close(fd)
                fd = target
    except (TypeError, ValueError):
        pass
    os.set_inheritable(fd, True)
    return fd


def _reseed():
    """Draw new seeds where a fresh process's import would have drawn its own (docs/preload.md, "Random state")."""
    torch = sys.modules.get("torch")
    generator = getattr(torch, "default_generator", None)
    if generator is not None and generator.initial_seed() != TORCH_FIXED_SEED:
        generator.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None and hasattr(numpy_random, "seed"):
        numpy_random.seed()


def main(argv: list[str] | None = None) -> int:
    """Serve as the fork server: argv is [socket fd, comma-separated modules]; return the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(argv[0]))
    modules = [m for m in argv[1].split(",") if m]
    import spmd.runtime.runner  # noqa: F401 - what every rank runs: imported once, here, before any fork

    why = load(modules)
    if why is not None:
        tell(sock, {"error": why})
        return end_now(1)
    record_preloaded(modules)
    send(sock, {"ready": modules, "pid": os.getpid()})
    return run_rank(serve(sock))


def run_rank(script: list[str] | None) -> int:
    """What a server's main ends with: in a forked rank, run its script (run_script ends the rank with
    SystemExit, which leaves through every frame above); script None, end the server that served."""
    from spmd.runtime.runner import run_script  # imported by main already

    if script is None:
        return end_now(0)
    run_script(script)
    return 0


if __name__ == "__main__":
    from spmd.launch.forkserver.forker import main as _main  # the module's own globals, not __main__'s

    sys.exit(_main())
