"""Start N local ranks of one script and supervise them: ``spmd run``.

No MPI is needed: the launcher sets ``SPMD_*``, ``MASTER_ADDR`` and
``MASTER_PORT`` for each child, hands rank 0 an already listening socket
(``SPMD_LISTEN_FD``) so that concurrent launches never race for a port,
prefixes every output line with its rank, and stops the whole job as soon
as one rank fails.  With ``preload`` the ranks are forked from one process
that imported those modules first (spmd.launch.forkserver; with ``preload_keep`` a
server kept across launches, spmd.launch.forkserver.kept), under the same
supervision.  Only the standard library is imported here.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from spmd.errors import LaunchError, RendezvousError
from spmd.runtime.output import prefix as line_tag
from spmd.runtime.secret import new as new_secret
from spmd.launch.forkserver.client import ForkServer
from spmd.launch.forkserver.kept import attach
from spmd.launch.forkserver.process import death_signal
from spmd.failfast.hub import PEER_EXIT
from spmd.util.words import exit_text, signal_name

__all__ = ["launch", "child_env", "STRIPPED"]

#: Variables of other launchers removed from the children's environment.
STRIPPED = (
    # torchrun
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    # MPI (PMI, PMIx, Open MPI, MVAPICH, MPICH/Hydra)
    "PMI_RANK", "PMI_SIZE", "PMIX_RANK",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
    "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
    # Slurm task placement (the job's own variables are kept)
    "SLURM_PROCID", "SLURM_LOCALID",
    # an enclosing spmd launch
    "SPMD_RANK", "SPMD_SIZE", "SPMD_LOCAL_RANK", "SPMD_LOCAL_SIZE",
    "SPMD_NODE_RANK", "SPMD_NUM_NODES", "SPMD_LISTEN_FD",
)

GRACE = 3.0  # seconds between SIGTERM and SIGKILL
POLL = 0.05  # seconds between checks of the children
SETTLE = 3.0  # seconds the other ranks get to report a failure and exit by themselves
CAUSE_WAIT = 10.0  # ... and, while only ranks a peer ended (75) have exited, for the rank that failed


def child_env(rank, size, *, port, master_addr="127.0.0.1", backend=None,
              timeout=None, listen_fd=None, base=None, prefixed=False, secret=None):
    """Return the environment of local rank ``rank`` of ``size``.

    secret: the job's (SPMD_SECRET), which rank 0's store asks of every connection.
    prefixed: the launcher prefixes each line of the child's output itself,
    so the child must not (SPMD_TAG_OUTPUT=0).
    """
    env = dict(os.environ if base is None else base)
    for name in STRIPPED:
        env.pop(name, None)
    env.update(
        SPMD_RANK=str(rank), SPMD_SIZE=str(size),
        SPMD_LOCAL_RANK=str(rank), SPMD_LOCAL_SIZE=str(size),
        SPMD_NODE_RANK="0", SPMD_NUM_NODES="1",
        MASTER_ADDR=master_addr, MASTER_PORT=str(port),
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # huge pages for torch's buffers, as numpy gets
    if backend is not None:
        env["SPMD_BACKEND"] = backend
    if timeout is not None:
        t = float(timeout)
        env["SPMD_TIMEOUT"] = str(int(t)) if t.is_integer() else repr(t)
    if listen_fd is not None:
        env["SPMD_LISTEN_FD"] = str(listen_fd)
    if secret is not None:
        env["SPMD_SECRET"] = secret
    if prefixed:
        env["SPMD_TAG_OUTPUT"] = "0"
    return env


def launch(argv, nprocs, *, backend=None, prefix=None, timeout=None,
           master_addr="127.0.0.1", runner=("-m", "spmd"), env=None, preload=None, preload_keep=0,
           outcome=None):
    """Run ``python *runner *argv`` as ``nprocs`` ranks; return exit code.

    preload: modules that one fork server imports before forking every rank
    from itself, so that the ranks skip those imports (spmd.launch.forkserver); the
    ranks then run spmd's runner, the default runner, in-process.
    preload_keep: seconds > 0 to fork them from this user's kept server
    for these modules, environment and directory instead, started if none
    serves and left running until idle that long (spmd.launch.forkserver.kept).
    outcome: a dict that receives how the job ended, for spmd.launch.restarts:
    rank and returncode of the failure reported (None if none), and stopped,
    the first signal that stopped the launcher (None if none).
    """
    argv = list(argv)
    if not argv:
        raise LaunchError("nothing to run: argv is empty")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise LaunchError(f"nprocs must be an integer >= 1, got {nprocs!r}")
    if isinstance(preload_keep, bool) or not isinstance(preload_keep, (int, float)) or not preload_keep >= 0:
        raise LaunchError(f"preload_keep must be a number of seconds >= 0, got {preload_keep!r}")
    if preload_keep and not preload:
        raise LaunchError("preload_keep keeps a fork server of preloaded modules: give preload too")
    if preload and tuple(runner) != ("-m", "spmd"):
        raise LaunchError(f"preload forks ranks that run spmd's runner (runner=('-m', 'spmd')), "
                          f"not runner={tuple(runner)!r}: drop preload or the runner")
    if prefix is None:
        prefix = nprocs > 1
    command = [sys.executable, *runner, *argv]
    out = _Output(sys.stdout, sys.stderr)
    stop = []  # signals received by the launcher
    procs, pumps, server, extra = [], [], None, []  # extra: the fork server's output pumps
    sock = _listen(master_addr, nprocs)
    restore = _trap(lambda signum, frame: stop.append(signum))
    try:
        port = sock.getsockname()[1]
        preexec = _death_signal()
        secret = new_secret().decode()
        envs = [child_env(rank, nprocs, port=port, master_addr=master_addr, backend=backend,
                          timeout=timeout, listen_fd=sock.fileno() if rank == 0 else None,
                          base=env, prefixed=prefix, secret=secret) for rank in range(nprocs)]
        started = True
        if preload and preload_keep:
            server = attach(preload, _shared(envs), preload_keep, stop=stop, echo=out.write)
            started = server is not None  # None: stopped by a signal while attaching
        elif preload:
            server = ForkServer(preload, _shared(envs), piped=prefix, preexec_fn=preexec)
            if prefix:  # what the imports print, untagged
                extra = [out.pump(server.proc.stdout, b"", err=False),
                         out.pump(server.proc.stderr, b"", err=True)]
            started = server.ready(stop)  # False: stopped by a signal while it imported
        for rank in range(nprocs if started else 0):
            if server is not None:
                procs.append(server.spawn(
                    rank, argv, envs[rank], stdin_fd=_stdin() if rank == 0 else None,
                    pipes=prefix, listen=sock if rank == 0 else None))
                continue
            fd = sock.fileno() if rank == 0 else None
            procs.append(subprocess.Popen(
                command,
                env=envs[rank],
                pass_fds=() if fd is None else (fd,),
                stdin=None if rank == 0 else subprocess.DEVNULL,
                stdout=subprocess.PIPE if prefix else None,
                stderr=subprocess.PIPE if prefix else None,
                start_new_session=True, preexec_fn=preexec,
            ))
        if server is not None:
            server.done()
        sock.close()
        if prefix:
            for rank, p in enumerate(procs):
                tag = line_tag(rank, nprocs).encode()  # the same as SPMD_TAG_OUTPUT's
                pumps += [out.pump(p.stdout, tag, err=False),
                          out.pump(p.stderr, tag, err=True)]
        failed = _supervise(procs, stop)
        if failed is not None:
            rank, code = failed
            if outcome is not None:
                outcome.update(rank=rank, returncode=code)
            for t in pumps[2 * rank:2 * rank + 2]:  # its last words first
                t.join(timeout=1.0)
            out.say(f"spmd run: rank {rank} {exit_text(code)}\n")
            return code if code > 0 else 128 - code
        if stop:
            out.say(f"spmd run: {signal_name(stop[0])} received, stopping\n")
            return 128 + stop[0]
        return 0
    finally:
        sock.close()
        if server is not None:
            server.done()  # it reports how the ranks end from now on
        _terminate(procs, stop)
        if server is not None:
            server.close()
        restore()
        if outcome is not None:
            outcome.setdefault("rank", None)
            outcome.setdefault("returncode", None)
            outcome["stopped"] = stop[0] if stop else None
        for t in pumps + extra:
            t.join(timeout=GRACE)


#: Variables of one rank that the fork server's own environment leaves out.
_PER_RANK = ("SPMD_RANK", "SPMD_LOCAL_RANK", "SPMD_LISTEN_FD")


def _shared(envs):
    """Return what every rank's environment holds alike: the fork server's environment."""
    first, rest = envs[0], envs[1:]
    return {k: v for k, v in first.items()
            if k not in _PER_RANK and all(e.get(k) == v for e in rest)}


def _stdin():
    """Return the launcher's stdin for rank 0 to share, or None (rank 0 then reads /dev/null)."""
    try:
        os.fstat(0)
    except OSError:
        return None
    return 0


def _listen(addr, backlog):
    """Bind and listen on a free port of ``addr``; return the socket."""
    try:
        family, type_, proto, _, sockaddr = socket.getaddrinfo(
            addr, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, type_, proto)
    except OSError as e:
        raise RendezvousError(f"cannot listen on {addr!r}: {e}") from None
    try:
        sock.bind(sockaddr)
        sock.listen(max(backlog, socket.SOMAXCONN))
    except OSError as e:
        sock.close()
        raise RendezvousError(
            f"cannot listen on {addr!r}: {e}; --master-addr must be an "
            "address of this machine") from None
    return sock


def _supervise(procs, stop):
    """Wait for all ranks; return (rank, returncode) of the first failure."""
    live = dict(enumerate(procs))
    while live and not stop:
        for rank, p in list(live.items()):
            code = p.poll()
            if code is None:
                continue
            del live[rank]
            if code != 0:
                return _first_cause(procs, rank, code, stop)
        time.sleep(POLL)
    return None


def _first_cause(procs, rank, code, stop=()):
    """Return the failure to report: the rank that failed, not ranks its failure ended.

    The other ranks get up to SETTLE seconds to exit by themselves before
    they are terminated: the hub in rank 0 needs that moment to name a rank
    that died without a word (a SIGKILL), and a rank that raised may exit
    a moment after the peers it brought down (status PEER_EXIT), whose
    status must not stand for its own: while no other status has been
    seen, the wait goes on up to CAUSE_WAIT seconds.
    """
    first = (rank, code) if code != PEER_EXIT else None
    start = time.monotonic()
    while not stop:
        codes = [p.poll() for p in procs]
        if first is None:
            first = next(((r, c) for r, c in enumerate(codes) if c not in (None, 0, PEER_EXIT)), None)
        if None not in codes:
            break
        if time.monotonic() - start >= (SETTLE if first is not None else max(SETTLE, CAUSE_WAIT)):
            break
        time.sleep(POLL)
    return first or (rank, code)


def _terminate(procs, stop):
    """Stop every child's process group: SIGTERM, then SIGKILL after GRACE."""
    if any(p.poll() is None for p in procs):
        _killpg(procs, signal.SIGTERM)
        seen = len(stop)
        deadline = time.monotonic() + GRACE
        while (any(p.poll() is None for p in procs)
               and time.monotonic() < deadline and len(stop) == seen):
            time.sleep(POLL)
    _killpg(procs, signal.SIGKILL)  # also grandchildren left in the groups
    for p in procs:
        p.wait()


def _killpg(procs, signum):
    """Send ``signum`` to the process group of each child."""
    for p in procs:
        try:
            os.killpg(p.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _trap(handler):
    """Route SIGINT and SIGTERM to ``handler``; return a function to undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    signums = (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.signal(s, handler) for s in signums}

    def restore():
        for signum, previous in old.items():
            signal.signal(signum, previous)

    return restore


def _death_signal():
    """Return a preexec_fn that kills the child when the launcher dies."""
    return death_signal(os.getpid())


class _Output:
    """Write whole lines to stdout or stderr, one writer at a time."""

    def __init__(self, stdout, stderr):
        self._streams = (stdout, stderr)
        self._lock = threading.Lock()

    def write(self, data, err=False):
        """Write the bytes ``data`` and flush."""
        stream = self._streams[err]
        with self._lock:
            buf = getattr(stream, "buffer", None)
            if buf is None:
                stream.write(data.decode(errors="replace"))
            else:
                stream.flush()
                buf.write(data)
                buf.flush()
            stream.flush()

    def say(self, text):
        """Write the launcher's own message to stderr."""
        self.write(text.encode(), err=True)

    def pump(self, pipe, tag, err):
        """Forward each line of ``pipe`` with ``tag`` in a daemon thread."""
        def run():
            with pipe:
                for line in iter(pipe.readline, b""):
                    if not line.endswith(b"\n"):
                        line += b"\n"
                    self.write(tag + line, err)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread
