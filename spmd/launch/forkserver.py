"""``spmd run --preload torch,numpy``: import once, then start every rank by fork.

Importing torch costs each rank one to two and a half CPU-seconds; eight
ranks on a two-core machine spend most of a short job importing.  With
``--preload`` the launcher first starts one *fork server*, a fresh
``python -m spmd.launch.forkserver`` that imports the listed modules (and spmd's
runner) in its only thread, checks that forking it is safe, and then forks
every rank from itself: the ranks start with the modules already in
``sys.modules``.

Design: the ranks are the server's children; the server reports each
rank's pid and relays its exit status to the launcher.  The launcher and
the server talk over one ``AF_UNIX`` ``SOCK_SEQPACKET`` socket pair (a
message per write, file descriptors riding along with ``SCM_RIGHTS``):

    launcher -> server   {"rank", "argv", "set", "unset"} + stdin, stdout, stderr[, listening socket]
    server -> launcher   {"ready"} or {"error"} once, then {"rank", "pid"} per rank
                         and {"rank", "exit"} when it ends (``waitpid``: -N for signal N)

On the launcher's side each rank is a ``Forked``, an object with the
``subprocess.Popen`` methods the launcher's supervision uses (``pid``,
``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``,
``kill``, ``stdout``, ``stderr``), so ``spmd.launch.supervise`` supervises forked and
spawned ranks with the same code.  A subreaper scheme (the ranks re-parented
to the launcher when the server exits) was not taken: a rank's
``PR_SET_PDEATHSIG`` fires when its parent exits, so the ranks would have
to re-arm it after the server's exit, racing it; and the launcher could not
wait for a rank before the server had gone.

What a forked rank gets, the same as a rank ``spmd run`` starts without
preload: a session and process group of its own (``setsid``, so the
launcher's ``killpg`` reaches it and its children); SIGKILL when its parent
dies (``PR_SET_PDEATHSIG``; the server has the same on the launcher, so
the launcher's death still ends every rank, and the server's ends its
ranks, which the launcher then reports killed by SIGKILL); stdin, stdout
and stderr as the launcher passes them (pipes it prefixes per rank, or its
own); the listening socket of rank 0, given to rank 0 only, under the
launcher's number where that is free (``SPMD_LISTEN_FD`` names it); the
environment: the server starts with what every rank's ``child_env``
shares, and each rank sets its own values (``SPMD_RANK``, ...) after the
fork (what an import changed stays changed, as after the script's own
import); and the script run by ``spmd.runtime.runner.run_script``, the function
``python -m spmd`` runs, so ``sys.argv``, ``sys.path[0]``, ``-m module``,
tracebacks, ``SystemExit`` codes and fail-fast are those of a rank without
preload.  The server is ``python -m spmd.launch.forkserver``, started as ``python -m
spmd`` is (``sys.path[0]`` the working directory).

What differs, besides the imports done: ``ps`` and ``/proc/PID/cmdline``
show the server's command line for every rank, and ``/proc/PID/environ``
the server's environment (``os.environ`` is right); ``sys.orig_argv`` is
the server's; and what the next two paragraphs say of seeds and ``gc``.
What the imports print goes to the launcher's stdout and stderr untagged.

Random state: Python's ``random`` reseeds itself in a forked child (its own
``os.register_at_fork``).  torch's default CPU generator and numpy's global
``RandomState`` are seeded from the operating system when a fresh process
imports them, so each rank reseeds them from the operating system after
the fork (``torch.default_generator.seed()``, ``numpy.random.seed()``, the
latter only where ``numpy.random`` was imported), and ranks differ as they
would without preload.  (A torch build whose default seed is fixed,
67280421310721, is left alone: its ranks start alike either way.)  Not
reseeded: ``random.Random`` instances and generators that a preloaded
module created at import (alike on every rank), the seed of ``str``
hashes (one per server, so alike on every rank, where fresh ranks draw
their own unless PYTHONHASHSEED is set), and a seed a preloaded module set
at import (replaced; seed in the script).

Memory: before each fork the server calls ``gc.freeze()``, as CPython's
``gc`` documentation advises for a process that forks without exec: what
the imports made moves to the permanent generation, which a rank's
collections never traverse, so its pages stay shared and a rank's exit does
not walk them (eight ranks of jobs/scatter_gather.py on two cores: 4.4 s
wall and 7.6 CPU-seconds without it, 3.1 s and 4.9 with it).  What a script
can see of it: ``gc.get_objects()`` leaves those objects out,
``gc.get_freeze_count()`` is not 0, and a reference cycle among them is
never collected.

Refused, with a ``LaunchError`` naming the problem and the fix: a module
that cannot be imported; CUDA initialised by an import; a Python thread
running after an import; MPI initialised by an import (mpi4py.MPI); a
forked child of the server that cannot run a torch (and numpy) matrix
product within ``PROBE_SECONDS`` (an OpenMP thread pool started by an
import makes a forked child hang in its first parallel region); and a
platform without ``fork`` or ``SOCK_SEQPACKET`` (not Linux).  Native
threads that survive ``fork`` by design are allowed: numpy's OpenBLAS
starts its pool at import and re-creates it after a fork.

A server kept across launches (``--preload-keep``) is spmd.launch.kept:
for each launch it forks a session that runs ``_serve`` with ``watch``,
and the launcher drives it through a ``ForkServer`` made on the connection.

Only the standard library is imported on the launcher's side.
"""

import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from spmd.errors import LaunchError
from spmd.util.paths import FORK_SERVER

__all__ = ["ForkServer", "Forked", "parse_modules", "preloaded", "death_signal", "PROBE_SECONDS"]

#: Seconds a forked probe child may take for its matrix products before the server is refused.
PROBE_SECONDS = 5.0
#: Bytes of one message, at most (a rank's request carries only what differs from the server's environment).
MAX_MESSAGE = 1 << 20
#: torch's historical fixed default seed: a build that starts every process with it is not reseeded.
TORCH_FIXED_SEED = 67280421310721
#: Seconds between a watching server's checks that its launcher is still there (_serve's watch).
WATCH_POLL = 0.01

# In the server and every rank forked from it: the modules it imported (preloaded() returns them).
_preloaded = ()


def preloaded():
    """Return the modules this process's fork server imported before forking it; () if not forked."""
    return _preloaded


def parse_modules(text):
    """Return the module names of a comma-separated list; LaunchError for a name that is not one."""
    names = [part.strip() for part in text.split(",")]
    names = [n for n in names if n]
    if not names:
        raise LaunchError(f"--preload {text!r} names no module: give a comma-separated list, e.g. torch,numpy")
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise LaunchError(f"--preload: {name!r} is not a module name (e.g. torch, numpy, torch.distributed)")
    return list(dict.fromkeys(names))


def death_signal(parent):
    """Return a function that makes the calling child of parent (a pid) die with it, by SIGKILL.

    The function exits at once if parent has already gone.  None off Linux
    (PR_SET_PDEATHSIG is Linux's) or where prctl cannot be found.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def arm():
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl
            os._exit(1)

    return arm


def _die_with(parent):
    """In a child of parent (the server's pid, read before the fork): die with it."""
    arm = death_signal(parent)
    if arm is not None:
        arm()


# -- messages ------------------------------------------------------------------------------

def _send(sock, message, fds=()):
    """Send one JSON message, with fds attached."""
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def _recv(sock):
    """Receive one message and its fds; (None, []) at the end of the stream (or a peer that left abruptly)."""
    try:
        data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, 8)
    except ConnectionResetError:  # the peer closed with our messages unread
        return None, []
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        raise LaunchError("spmd run --preload: a message between the launcher and its fork server was cut")
    if not data:
        return None, fds
    return json.loads(data), fds


# -- the launcher's side ---------------------------------------------------------------------

class Forked:
    """A rank forked by the server, as the launcher's supervision sees a subprocess.Popen."""

    def __init__(self, server, rank, pid, stdout=None, stderr=None):
        self._server, self.rank, self.pid = server, rank, pid
        self.stdout, self.stderr = stdout, stderr
        self.returncode = None

    def poll(self):
        """Return the exit status if the rank has ended (as Popen: -N for signal N), else None."""
        if self.returncode is None:
            self._server.collect(0)
        return self.returncode

    def wait(self, timeout=None):
        """Wait for the rank to end and return its status; subprocess.TimeoutExpired after timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"rank {self.rank}", timeout)
            self._server.collect(left)
        return self.returncode

    def send_signal(self, signum):
        """Send signum to the rank, unless it has ended."""
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's end of a fork server: start it, fork ranks from it, learn how they end.

    env: the server's environment (what every rank's environment shares);
    piped: give the server pipes for stdout and stderr (as the ranks get
    when the launcher prefixes their lines), to read as proc.stdout and
    proc.stderr.  sock: a connection to a server that already serves
    (a kept one's session, spmd.launch.kept): nothing is started, and
    proc is None.
    """

    def __init__(self, modules, env, *, piped=False, preexec_fn=None, sock=None):
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

    def ready(self, stop=()):
        """Wait for the server's imports; return True, or False if stop filled first; LaunchError if refused."""
        if self._served:
            return True
        while not stop:
            if select.select([self._sock], [], [], 0.05)[0]:
                message, fds = _recv(self._sock)
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

    def spawn(self, rank, argv, env, *, stdin_fd=None, pipes=False, listen=None):
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
            _send(self._sock, request, theirs)
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

    def collect(self, timeout):
        """Read the server's messages for up to timeout seconds (None: until one comes); 0: only what is there."""
        if self._gone:
            return
        ready = select.select([self._sock], [], [], timeout)[0]
        while ready:
            message, fds = _recv(self._sock)
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

    def done(self):
        """Tell the server that no more ranks come: it then only waits for them and reports."""
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self):
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


# -- the server's side -----------------------------------------------------------------------

def _load(modules):
    """Import modules in order; return why forking is unsafe now, or None."""
    import importlib
    import traceback

    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as e:  # an import that exits or fails: name it
            last = traceback.format_exception_only(type(e), e)[-1].strip()
            return (f"--preload: cannot import {name!r} ({last}): check the name, or run the same "
                    f"python (`{sys.executable} -c 'import {name}'`) to see why")
        why = _unsafe(name)
        if why is not None:
            return why
    return _probe(modules)


def _unsafe(name):
    """Return why forking is unsafe after importing name, or None."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        names = ", ".join(f"{t.name!r}" + (" (daemon)" if t.daemon else "") for t in others)
        return (f"--preload: importing {name!r} started {len(others)} thread(s) ({names}); forking a "
                f"process with threads running is unsafe: remove {name!r} from --preload (let the "
                "script import it)")
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return (f"--preload: importing {name!r} initialised CUDA, which a forked process cannot use "
                f"(torch refuses it in a forked child): remove {name!r} from --preload, or run without "
                "--preload")
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        return (f"--preload: importing {name!r} initialised MPI, which a forked process cannot use: "
                "remove it from --preload (spmd starts MPI in each rank)")
    return None


def _probe(modules):
    """Fork a child that runs torch's and numpy's matrix products; return why it failed, or None.

    A forked child of a process whose OpenMP pool was started (by an import
    that computed something in parallel) hangs in its first parallel region.
    """
    torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")
    if torch is None and numpy is None:
        return None
    _flush()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the probe
        code = 1
        try:
            _die_with(parent)
            if torch is not None:
                a = torch.ones(256, 256)
                (a @ a).sum().item()
                torch.ones(1 << 17).add_(1)  # an elementwise parallel_for
            if numpy is not None:
                b = numpy.ones((256, 256))
                (b @ b).sum()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + PROBE_SECONDS
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.005)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return (f"--preload: after importing {','.join(modules)}, a forked child did not finish a matrix "
                f"product within {PROBE_SECONDS:g} s: an import most likely ran a parallel computation, "
                "whose OpenMP threads a forked child cannot use (it hangs); remove that module from "
                "--preload, or run without --preload")
    if os.waitstatus_to_exitcode(status) != 0:
        return (f"--preload: after importing {','.join(modules)}, a forked child could not run a matrix "
                f"product (exit status {os.waitstatus_to_exitcode(status)}): run without --preload")
    return None


def _flush():
    """Flush Python's stdout and stderr, so a child does not write what the server buffered."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass


def _serve(sock, watch=False):
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
            message, fds = _recv(sock)
            if message is None:  # the launcher has sent every request
                requests = False
                continue
            rank = message["rank"]
            _flush()
            gc.freeze()  # what the imports made: never traversed by a rank's collections, nor copied by them
            try:
                pid = os.fork()
            except OSError as e:
                for fd in fds:
                    os.close(fd)
                _tell(sock, {"rank": rank, "error": f"fork failed: {e}"})
                continue
            if pid == 0:
                return _become(sock, message, fds, server)
            for fd in fds:
                os.close(fd)
            ranks[pid] = rank
            _tell(sock, {"rank": rank, "pid": pid})
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
                if _hung_up(sock, WATCH_POLL):
                    return None
                continue
            if pid in ranks:
                _tell(sock, {"rank": ranks.pop(pid), "exit": os.waitstatus_to_exitcode(status)})
            if not flags:  # one at a time while nothing else is to be done
                break
    return None


def _hung_up(sock, timeout):
    """Wait up to timeout seconds for sock's peer to close its end; tell whether it has.

    An AF_UNIX socket reports POLLHUP only once the peer has closed it, not
    when the peer has only shut down its writing side.
    """
    poller = select.poll()
    poller.register(sock, 0)  # POLLHUP and POLLERR come whatever is asked for
    return bool(poller.poll(timeout * 1000))


def _tell(sock, message):
    """Send message unless the launcher is gone (then the server has no one to tell)."""
    try:
        _send(sock, message)
    except OSError:
        pass


def _become(sock, message, fds, server):
    """In a freshly forked child: become the rank message describes; return its argv for run_script."""
    os.setsid()
    _die_with(server)
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
    """Draw new seeds where a fresh process's import would have drawn its own (see the module's docstring)."""
    torch = sys.modules.get("torch")
    generator = getattr(torch, "default_generator", None)
    if generator is not None and generator.initial_seed() != TORCH_FIXED_SEED:
        generator.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None and hasattr(numpy_random, "seed"):
        numpy_random.seed()


def main(argv=None):
    """Serve as the fork server: argv is [socket fd, comma-separated modules]; return the exit status."""
    global _preloaded

    argv = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(argv[0]))
    modules = [m for m in argv[1].split(",") if m]
    from spmd.runtime.runner import run_script  # what every rank runs: imported once, here

    why = _load(modules)
    if why is not None:
        _tell(sock, {"error": why})
        return _end(1)
    _preloaded = tuple(modules)
    _send(sock, {"ready": modules, "pid": os.getpid()})
    script = _serve(sock)
    if script is None:
        return _end(0)
    run_script(script)  # a rank: run_script ends it with SystemExit, which leaves through every frame above
    return 0


def _end(code):
    """End the server now: its finalization (torch's modules) would cost the launcher half a second."""
    _flush()
    os._exit(code)


if __name__ == "__main__":
    from spmd.launch.forkserver import main as _main  # the module's own globals, not __main__'s

    sys.exit(_main())
