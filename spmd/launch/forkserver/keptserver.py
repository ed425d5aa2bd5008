"""The kept fork server: ``python -m spmd.launch.forkserver.keptserver FD PATH SECONDS MODULES``.

It imports MODULES once, reports on the pipe FD, listens on the socket PATH
and forks a *session* per launch, which serves that launch's ranks as a
non-kept server does (spmd.launch.forkserver.forker's ``serve``, watching
the connection); it exits once idle for SECONDS, when a watched file has
changed, or when its socket file is removed.  docs/preload.md ("Keeping the
server", "The kept server's protocol") is the reference.
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import select
import socket
import stat
import struct
import sys
import time

from spmd.launch.forkserver.kept import CHECK_SECONDS, changed, lock_path, snapshot
from spmd.launch.forkserver.process import end_now, flush_std, record_preloaded
from spmd.launch.forkserver.protocol import recv, tell
from spmd.launch.forkserver.safety import load
from spmd.launch.forkserver.forker import run_rank, serve

__all__ = ["main"]

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _log(text):
    """Say text on the server's stderr (its .err file)."""
    try:
        os.write(2, f"spmd preload server (pid {os.getpid()}): {text}\n".encode())
    except OSError:
        pass


def _size(fd):
    try:
        return os.fstat(fd).st_size
    except OSError:
        return 0


def _report(fd, message):
    """Tell the launcher starting this server how its start goes (unless that launcher has gone)."""
    try:
        os.write(fd, json.dumps(message).encode() + b"\n")
    except OSError:
        pass


def _bind(path):
    """Listen on path (only this user can reach it: mode 0600 in a 0700 directory)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(64)
    return listener


def _ours(path, ino):
    """Tell whether path is still the socket this server bound."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISSOCK(st.st_mode) and st.st_ino == ino


def _retire(listener, path, ino, block):
    """Stop listening: under the lock remove the socket (if still ours) and return the waiting connections.

    None (nothing done) if the lock is held and block is false: a launcher is connecting.
    """
    try:
        fd = os.open(lock_path(path), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:  # the directory has gone: nobody can connect any more
        fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            return None
        if _ours(path, ino):
            os.unlink(path)
        waiting = []
        listener.setblocking(False)
        while True:
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            conn.setblocking(True)
            waiting.append(conn)
        listener.close()
        return waiting
    finally:
        os.close(fd)  # and with it the lock


def _handle(conn, listener, path, ino, stamps, sessions):
    """Serve one connection: "session" in the forked session, "stale" if the server must go, else None."""
    _, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    if uid != os.getuid():
        _log(f"dropped a connection from uid {uid}")
        conn.close()
        return None
    why = changed(stamps)
    if why is not None:
        _log(f"stale ({why}): exiting")
        waiting = [] if listener is None else _retire(listener, path, ino, block=True)
        for c in [conn, *waiting]:
            tell(c, {"stale": why})
            c.close()
        return "stale"
    flush_std()
    try:
        pid = os.fork()
    except OSError as e:
        tell(conn, {"error": f"spmd run --preload-keep: the kept fork server cannot fork ({e})"})
        conn.close()
        return None
    if pid == 0:
        if listener is not None:
            listener.close()
        return "session"
    conn.close()
    sessions.add(pid)
    return None


def _reap(sessions):
    """Forget the sessions that have ended; return how many did."""
    ended = 0
    for pid in list(sessions):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            sessions.discard(pid)
            ended += 1
    return ended


def _loop(listener, path, keep, stamps):
    """Accept launches until idle for keep seconds; return the connection in a session, None in the server."""
    ino = os.stat(path).st_ino
    sessions = set()
    last = checked = time.monotonic()
    while True:
        now = time.monotonic()
        if _reap(sessions):
            last = now
        waiting = None
        if not sessions and now - last >= keep:
            waiting = _retire(listener, path, ino, block=False)
            if waiting is None:  # a launcher holds the lock: it may be connecting
                time.sleep(0.01)
                continue
            _log(f"idle for {keep:g} s: exiting")
        elif now - checked >= CHECK_SECONDS:
            checked = now
            if not _ours(path, ino):
                waiting = _retire(listener, path, ino, block=True)
                _log(f"{path} was removed or replaced: exiting")
        if waiting is not None:  # retired: serve who connected before that, then go
            for i, conn in enumerate(waiting):
                if _handle(conn, None, path, ino, stamps, sessions) == "session":
                    for other in waiting[i + 1:]:  # the next sessions' connections, not this one's
                        other.close()
                    return conn
            return None
        wait = CHECK_SECONDS if sessions else min(CHECK_SECONDS, max(0.0, keep - (now - last)))
        if not select.select([listener], [], [], wait)[0]:
            continue
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            continue
        last = time.monotonic()
        done = _handle(conn, listener, path, ino, stamps, sessions)
        if done == "session":
            return conn
        if done == "stale":
            return None


def _session(conn, modules):
    """In a session: take the launch's environment and directory, then serve its ranks (server.serve)."""
    server = os.getppid()
    message, fds = recv(conn)
    if message is None:
        return None
    for fd, target in zip(fds, (1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    try:
        os.chdir(message["cwd"])
    except OSError as e:
        tell(conn, {"error": f"spmd run --preload-keep: cannot change to {message['cwd']!r} ({e.strerror})"})
        return None
    os.environ.clear()
    os.environ.update(message["env"])
    tell(conn, {"ready": modules, "pid": os.getpid(), "server": server})
    return serve(conn, watch=True)


def main(argv: list[str] | None = None) -> int:
    """Serve as a kept fork server: argv is [status fd, socket path, keep seconds, modules]."""
    argv = sys.argv[1:] if argv is None else argv
    status, path, keep, modules = int(argv[0]), argv[1], float(argv[2]), [m for m in argv[3].split(",") if m]
    if os.fork():  # the launcher waits for this one only: the server is reparented away from it
        os._exit(0)
    _report(status, {"pid": os.getpid()})
    import spmd.runtime.runner  # noqa: F401 - what every rank runs: imported once, here, before any fork

    why = load(modules)
    if why is not None:
        _report(status, {"error": why})
        return end_now(1)
    record_preloaded(modules)
    flush_std()
    said = [_size(1), _size(2)]  # what the imports printed: the starting launch shows that much of each file
    stamps = snapshot()
    began = time.perf_counter()
    changed(stamps)  # once, to say what each connection's check costs
    _log(f"imported {','.join(modules)}; watching {len(stamps)} files for changes "
         f"({(time.perf_counter() - began) * 1e3:.1f} ms a check); idle exit after {keep:g} s")
    gc.freeze()  # the imports' objects: never traversed by the server's collections, so their pages stay shared
    try:
        listener = _bind(path)
    except OSError as e:
        _report(status, {"error": f"spmd run --preload-keep: cannot listen on {path} ({e}): remove it, or "
                                  "run without --preload-keep"})
        return end_now(1)
    _report(status, {"ready": modules, "pid": os.getpid(), "said": said})
    os.close(status)
    conn = _loop(listener, path, keep, stamps)
    if conn is None:
        return end_now(0)
    return run_rank(_session(conn, modules))


if __name__ == "__main__":
    from spmd.launch.forkserver.keptserver import main as _main  # the module's own globals, not __main__'s

    sys.exit(_main())
