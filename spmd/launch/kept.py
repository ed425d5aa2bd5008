"""``spmd run --preload MODULES --preload-keep SECONDS``: a fork server that outlives its launch.

Without ``--preload-keep`` every launch starts its own fork server
(spmd.launch.forkserver), which costs a Python start and the imports (0.9 s for
``import torch`` here) before the first rank exists.  With it the first
launch starts a *kept* server for this user that imports the modules once
and stays up until SECONDS pass with no launch; later launches with the
same key connect to it, and a *session* forked from it for each launch
forks that launch's ranks from the warm state.

Where: an ``AF_UNIX`` ``SOCK_SEQPACKET`` socket ``<dir>/preload-<key>.sock``
with ``<dir>`` = ``$XDG_RUNTIME_DIR/spmd`` when XDG_RUNTIME_DIR names a
writable directory, else ``/tmp/spmd-<uid>``; the directory is created with
mode 0700 and refused (LaunchError naming it and the fix) when it is not a
directory of this user's that only this user can reach.  The server takes
each connection's credentials (``SO_PEERCRED``) and drops one from another
uid (root's included) without forking anything.  Beside the socket:
``preload-<key>.lock`` (an ``flock`` held around "connect, or start a
server", and by a server around removing its socket) and
``preload-<key>.out`` / ``.err``, what the server printed: the launch that
started it copies what the imports printed to its own output once the
server is ready, so a user sees import warnings once.

The key: a hash of the protocol's version, ``sys.executable``, spmd's
directory, the module list, the working directory and the launch's shared
environment (what a non-kept server gets, spmd.launch.supervise's ``_shared``) less
the launch's own variables (every ``SPMD_*``, ``MASTER_ADDR``,
``MASTER_PORT``: the port differs at every launch, the size and backend
between launches; spmd reads none of them at import).  A launch with
another environment, working directory or module list gets a server of its
own: that is how a change of environment is honoured.

Protocol: the launcher connects and sends ``{"env", "cwd"}`` with its
stdout and stderr attached; the server answers ``{"stale"}`` (below) or
forks a session, which takes the launch's whole shared environment as
``os.environ``, changes to its directory, answers ``{"ready", "pid",
"server"}`` and from then on speaks spmd.launch.forkserver's per-launch protocol on
the same connection (``_serve``): the ranks are the session's children, and
``spmd.launch.supervise`` drives them as a non-kept server's.  The session is not
tied to the launcher by a death signal (it is not its child), so it
watches the connection instead: a shutdown of the launcher's writing side
after the last rank is the end of the requests, and a closed connection
(``POLLHUP``) the launcher's death, on which the session exits and its
ranks die of their own death signal, as with a non-kept server.

Staleness: after its imports the server records the modification time and
size of every file of every module in ``sys.modules`` and of every ``.py``
file of spmd itself, and checks them on each connection (a few
milliseconds for torch's); when one changed (a ``pip install -U``, an edited
module of the user's own) it removes its socket, answers ``{"stale"}`` to
this and every waiting connection, and exits, and the launcher starts a
fresh server.  A server that died leaves its socket file, which refuses
connections (``ECONNREFUSED``): the launcher removes it and starts another.

Lifetime: started detached (its own session, stdin ``/dev/null``, output to
the ``.out`` / ``.err`` files, reparented away from the launcher at once, no
death signal), it exits once SECONDS have passed with no connection and no
session running, or within ``CHECK_SECONDS`` of its socket file being
removed or replaced (``rm <dir>/preload-*.sock`` stops every kept server).
Sessions live on until their launches end.

Only the standard library is imported on the launcher's side.
"""

import errno
import fcntl
import gc
import hashlib
import json
import os
import select
import socket
import stat
import struct
import subprocess
import sys
import time

from spmd.launch import forkserver as preload
from spmd.errors import LaunchError
from spmd.launch.forkserver import ForkServer, _end, _flush, _load, _recv, _send, _serve, _tell
from spmd.util.paths import KEPT_SERVER, PACKAGE_DIR

__all__ = ["attach", "runtime_dir", "server_key", "ATTACH_SECONDS", "CHECK_SECONDS"]

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

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


# -- the launcher's side ---------------------------------------------------------------------

def runtime_dir(environ=None):
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


def server_key(modules, env, cwd=None, executable=None):
    """Return the key (16 hex digits) of the kept server for these modules, environment and directory."""
    blob = json.dumps([VERSION, executable or sys.executable, PACKAGE_DIR, list(modules), cwd or os.getcwd(),
                       sorted(_keyed(env).items())])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def attach(modules, env, keep, *, stop=(), echo=None):
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


def _lock(path, stop):
    """Take the flock beside path, waiting; return its fd, or None if stop filled first."""
    fd = os.open(path[:-5] + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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
        _send(sock, {"env": env, "cwd": cwd}, fds)
    except OSError:
        return None
    deadline = time.monotonic() + ATTACH_SECONDS
    while not stop and time.monotonic() < deadline:
        if select.select([sock], [], [], 0.05)[0]:
            message, fds = _recv(sock)
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
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


# -- the server's side -----------------------------------------------------------------------

def _snapshot():
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


def _changed(snapshot):
    """Return what changed since snapshot (a file, named), or None."""
    for path, stamp in snapshot.items():
        now = _stamp(path)
        if now != stamp:
            return f"{path} {'is gone' if now is None else 'changed'}"
    return None


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
        fd = os.open(path[:-5] + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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


def _handle(conn, listener, path, ino, snapshot, sessions):
    """Serve one connection: "session" in the forked session, "stale" if the server must go, else None."""
    _, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    if uid != os.getuid():
        _log(f"dropped a connection from uid {uid}")
        conn.close()
        return None
    why = _changed(snapshot)
    if why is not None:
        _log(f"stale ({why}): exiting")
        waiting = [] if listener is None else _retire(listener, path, ino, block=True)
        for c in [conn, *waiting]:
            _tell(c, {"stale": why})
            c.close()
        return "stale"
    _flush()
    try:
        pid = os.fork()
    except OSError as e:
        _tell(conn, {"error": f"spmd run --preload-keep: the kept fork server cannot fork ({e})"})
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


def _loop(listener, path, keep, snapshot):
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
                if _handle(conn, None, path, ino, snapshot, sessions) == "session":
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
        done = _handle(conn, listener, path, ino, snapshot, sessions)
        if done == "session":
            return conn
        if done == "stale":
            return None


def _session(conn, modules):
    """In a session: take the launch's environment and directory, then serve its ranks (spmd.launch.forkserver)."""
    server = os.getppid()
    message, fds = _recv(conn)
    if message is None:
        return None
    for fd, target in zip(fds, (1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    try:
        os.chdir(message["cwd"])
    except OSError as e:
        _tell(conn, {"error": f"spmd run --preload-keep: cannot change to {message['cwd']!r} ({e.strerror})"})
        return None
    os.environ.clear()
    os.environ.update(message["env"])
    _tell(conn, {"ready": modules, "pid": os.getpid(), "server": server})
    return _serve(conn, watch=True)


def main(argv=None):
    """Serve as a kept fork server: argv is [status fd, socket path, keep seconds, modules]."""
    argv = sys.argv[1:] if argv is None else argv
    status, path, keep, modules = int(argv[0]), argv[1], float(argv[2]), [m for m in argv[3].split(",") if m]
    if os.fork():  # the launcher waits for this one only: the server is reparented away from it
        os._exit(0)
    _report(status, {"pid": os.getpid()})
    from spmd.runtime.runner import run_script  # what every rank runs: imported once, here

    why = _load(modules)
    if why is not None:
        _report(status, {"error": why})
        return _end(1)
    preload._preloaded = tuple(modules)
    _flush()
    said = [_size(1), _size(2)]  # what the imports printed: the starting launch shows that much of each file
    snapshot = _snapshot()
    began = time.perf_counter()
    _changed(snapshot)  # once, to say what each connection's check costs
    _log(f"imported {','.join(modules)}; watching {len(snapshot)} files for changes "
         f"({(time.perf_counter() - began) * 1e3:.1f} ms a check); idle exit after {keep:g} s")
    gc.freeze()  # the imports' objects: never traversed by the server's collections, so their pages stay shared
    try:
        listener = _bind(path)
    except OSError as e:
        _report(status, {"error": f"spmd run --preload-keep: cannot listen on {path} ({e}): remove it, or "
                                  "run without --preload-keep"})
        return _end(1)
    _report(status, {"ready": modules, "pid": os.getpid(), "said": said})
    os.close(status)
    conn = _loop(listener, path, keep, snapshot)
    if conn is None:
        return _end(0)
    script = _session(conn, modules)
    if script is None:
        return _end(0)
    run_script(script)  # a rank: run_script ends it with SystemExit, which leaves through every frame above
    return 0


if __name__ == "__main__":
    from spmd.launch.kept import main as _main  # the module's own globals, not __main__'s

    sys.exit(_main())
