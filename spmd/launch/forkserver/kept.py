"""``spmd run --preload MODULES --preload-keep SECONDS``: a fork server that outlives its launch.

The launcher's side: ``attach`` connects to this user's kept server for a
launch's key (``server_key``) in its directory (``runtime_dir``), starting
one (spmd.launch.forkserver.keptserver) if none serves, and returns a
``ForkServer`` on the connection.  ``snapshot`` and ``changed`` are the
staleness check the server runs at each connection.  docs/preload.md
("Keeping the server", "The kept server's protocol") is the reference.
Only the standard library is imported.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from typing import Callable, Collection, Iterable, Mapping

from spmd.errors import LaunchError
from spmd.launch.forkserver.client import ForkServer
from spmd.launch.forkserver.protocol import recv, send
from spmd.util.paths import KEPT_SERVER, PACKAGE_DIR

__all__ = ["attach", "runtime_dir", "server_key", "snapshot", "changed", "lock_path",
           "ATTACH_SECONDS", "CHECK_SECONDS"]

#: Of the protocol between a launcher and a kept server: part of the key.
VERSION = 1
#: Seconds a launcher waits for a running kept server's answer (not for a new one's imports).
ATTACH_SECONDS = 60.0
#: Seconds between a kept server's checks of its socket file and of its sessions.
CHECK_SECONDS = 1.0
#: Attempts at connecting (a server may retire, stale or idle, just as a launch connects).
TRIES = 3
#: The longest socket path AF_UNIX takes, in bytes.
MAX_PATH = 107


def runtime_dir(environ: Mapping[str, str] | None = None) -> str:
    """Return the directory of this user's kept servers, created mode 0700; LaunchError if unsafe."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_RUNTIME_DIR", "")
    if base and os.path.isabs(base) and os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
        path = os.path.join(base, "spmd")
    else:
        path = f"/tmp/spmd-{os.getuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise LaunchError(f"--preload-keep: cannot create {path} ({e.strerror}): set XDG_RUNTIME_DIR to a "
                          "directory of yours, or run without --preload-keep") from None
    st = os.lstat(path)
    problem = None
    if not stat.S_ISDIR(st.st_mode):
        problem = "not a directory"
    elif st.st_uid != os.getuid():
        problem = f"owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    elif st.st_mode & 0o077:
        problem = f"open to other users (mode {stat.S_IMODE(st.st_mode):04o})"
    if problem is not None:
        raise LaunchError(f"--preload-keep: {path} is {problem}; the kept fork servers' directory must be "
                          f"yours alone: remove it (rm -r {path}), or if it is yours run chmod 700 {path}")
    return path


def _keyed(env):
    """The part of a launch's shared environment that picks its server: without the launch's own values."""
    return {k: v for k, v in env.items() if not k.startswith("SPMD_") and k not in ("MASTER_ADDR", "MASTER_PORT")}


def server_key(modules: Iterable[str], env: Mapping[str, str], cwd: str | None = None,
               executable: str | None = None) -> str:
    """Return the key (16 hex digits) of the kept server for these modules, environment and directory."""
    blob = json.dumps([VERSION, executable or sys.executable, PACKAGE_DIR, list(modules), cwd or os.getcwd(),
                       sorted(_keyed(env).items())])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def attach(modules: Iterable[str], env: Mapping[str, str], keep: float, *, stop: Collection[object] = (),
           echo: Callable[[bytes, bool], object] | None = None) -> ForkServer | None:
    """Connect to this user's kept server for (modules, env, cwd), starting one if none serves.

    Returns a ForkServer whose ranks a session of the kept server forks, or
    None if stop (the signals the launcher received) filled first.  keep:
    a new server's idle seconds; echo(data, err): writes what a server this
    call started printed while importing (bytes; err: stderr).  LaunchError
    for a refused import, as without keep.
    """
    if not hasattr(os, "fork") or not hasattr(socket, "SO_PEERCRED"):
        raise LaunchError(f"--preload-keep needs os.fork and SO_PEERCRED, which {sys.platform} lacks: "
                          "run without --preload-keep")
    cwd = os.getcwd()
    path = os.path.join(runtime_dir(), f"preload-{server_key(modules, env, cwd)}.sock")
    if len(os.fsencode(path)) > MAX_PATH:
        raise LaunchError(f"--preload-keep: the socket path {path} is longer than AF_UNIX allows "
                          f"({MAX_PATH} bytes): set XDG_RUNTIME_DIR to a shorter directory")
    for _ in range(TRIES):
        lock = _lock(path, stop)
        if lock is None:
            return None
        try:
            sock = _connect(path)
            if sock is None:
                if not _start(path, modules, env, keep, stop, echo):
                    return None
                sock = _connect(path)
        finally:
            os.close(lock)
        if sock is None:  # it started and then went at once: try again
            continue
        reply = _hello(sock, env, cwd, stop, path)
        if reply is not None and "ready" in reply:
            return ForkServer(modules, env, sock=sock)
        sock.close()
        if stop:
            return None
        if reply is not None and "error" in reply:
            raise LaunchError(reply["error"])
        # None: the server closed without a word (it retired as we came); stale: it has gone
    raise LaunchError(f"spmd run --preload-keep: no kept fork server answered at {path} in {TRIES} tries: "
                      f"see {path[:-5]}.err, remove {path}, or run without --preload-keep")


def lock_path(path: str) -> str:
    """Return the lock file beside a kept server's socket path (held around "connect, or start a server")."""
    return path[:-5] + ".lock"


def _lock(path, stop):
    """Take the flock beside path, waiting; return its fd, or None if stop filled first."""
    fd = os.open(lock_path(path), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if stop:
                os.close(fd)
                return None
            time.sleep(0.01)


def _connect(path):
    """Connect to the server at path; None if none serves there (a dead server's socket is removed)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(ATTACH_SECONDS)  # connect waits while the server's backlog is full
    try:
        sock.connect(path)
    except (FileNotFoundError, ConnectionRefusedError) as e:
        sock.close()
        if isinstance(e, ConnectionRefusedError):  # its server died: under the lock, nobody else binds it
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return None
    except OSError as e:
        sock.close()
        raise LaunchError(f"spmd run --preload-keep: cannot connect to {path} ({e}): remove it, or run "
                          "without --preload-keep") from None
    sock.settimeout(None)
    return sock


def _hello(sock, env, cwd, stop, path):
    """Send the launch's environment and directory; return the server's reply (None: it closed)."""
    fds = []
    for fd in (1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            break
    try:
        send(sock, {"env": env, "cwd": cwd}, fds)
    except OSError:
        return None
    deadline = time.monotonic() + ATTACH_SECONDS
    while not stop and time.monotonic() < deadline:
        if select.select([sock], [], [], 0.05)[0]:
            message, fds = recv(sock)
            for fd in fds:
                os.close(fd)
            return message
    if stop:
        return None
    sock.close()
    raise LaunchError(f"spmd run --preload-keep: the kept fork server at {path} did not answer "
                      f"within {ATTACH_SECONDS:g} s: remove that socket to stop it, or run without --preload-keep")


def _start(path, modules, env, keep, stop, echo):
    """Start a kept server for path; True once it serves, False if stop filled first; LaunchError if refused."""
    base = path[:-5]
    r, w = os.pipe()
    try:
        with open(base + ".out", "wb") as out, open(base + ".err", "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", KEPT_SERVER, str(w), path, repr(float(keep)), ",".join(modules)],
                env=env, pass_fds=(w,), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                start_new_session=True)
    finally:
        os.close(w)
    proc.wait()  # it forks the server and exits at once: the server is not the launcher's child
    pid, outcome, buf = None, None, b""
    try:
        while outcome is None:
            if stop:
                if pid is not None:
                    _kill(pid)
                return False
            if not select.select([r], [], [], 0.05)[0]:
                continue
            data = os.read(r, 65536)
            if not data:
                outcome = {}
                break
            buf += data
            while b"\n" in buf and outcome is None:
                line, buf = buf.split(b"\n", 1)
                message = json.loads(line)
                if "ready" in message or "error" in message:
                    outcome = message
                else:
                    pid = message.get("pid", pid)
    finally:
        os.close(r)
    if echo is not None:  # what the imports printed: shown once, by the launch that started the server
        said = outcome.get("said", [None, None])
        for suffix, is_err, size in ((".out", False, said[0]), (".err", True, said[1])):
            with open(base + suffix, "rb") as f:
                data = f.read(-1 if size is None else size)
            if data:
                echo(data, is_err)
    if "ready" in outcome:
        return True
    if "error" in outcome:
        raise LaunchError(outcome["error"])
    raise LaunchError(f"spmd run --preload: the kept fork server exited while importing {','.join(modules)}; "
                      f"see its output above, or run without --preload-keep")


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# -- staleness: what the server checks at each connection ---------------------------------

def snapshot() -> dict[str, tuple[int, int] | None]:
    """Return {file: (mtime_ns, size)} of every imported module's file and of spmd's own sources."""
    files = {f for m in list(sys.modules.values()) if isinstance(f := getattr(m, "__file__", None), str)}
    for root, dirs, names in os.walk(PACKAGE_DIR):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        files.update(os.path.join(root, n) for n in names if n.endswith(".py"))
    return {f: _stamp(f) for f in sorted(files)}


def _stamp(path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def changed(snapshot: dict[str, tuple[int, int] | None]) -> str | None:
    """Return what changed since snapshot (a file, named), or None."""
    for path, stamp in snapshot.items():
        now = _stamp(path)
        if now != stamp:
            return f"{path} {'is gone' if now is None else 'changed'}"
    return None
