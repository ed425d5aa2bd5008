"""Job-wide fail-fast and collective timeouts that no backend gives for free.

``Hub``: every rank keeps one TCP connection to a small hub in rank 0.  A rank that fails says so on its connection; a
rank that dies without a word (SIGKILL, os._exit) shows up as the
connection closing.  Either way the hub tells every rank to exit at once,
so nobody waits for the collective timeout, whatever the launcher.  Only
connections that open with the job's secret count (see docs/reliability.md,
"The hub's threat model"): anything else that connects is dropped, and no
input ends the hub's thread.

``MpiTimeout``: MPI collectives cannot be interrupted, so a thread watches
the collective in progress and, past the timeout, prints which collective
this rank was waiting in and aborts the job.
"""

import hmac
import ipaddress
import secrets
import selectors
import socket
import sys
import threading
import time

from .abort import PEER_EXIT, abort_job, exit_now  # PEER_EXIT, exit_now: also spmd.watchdog's, as before

__all__ = ["Hub", "MpiTimeout", "exit_now", "store_share", "PEER_EXIT"]

#: Seconds a new connection has to present the job's secret before the hub closes it.
HELLO_WITHIN = 1.0
#: The longest line the hub (or a rank) reads; a longer one closes that connection.
MAX_LINE = 256
#: Connections that have not presented the secret yet, at most; beyond, the oldest is closed.
MAX_PENDING = 64
#: Connections the hub accepts in one pass before it serves the ones it has.
ACCEPT_BATCH = 256
#: Seconds close() waits for a rank whose greeting has not been read yet.
CLOSE_WAIT = 2.0


class Hub:
    """Rank 0's relay of failures; one persistent, authenticated connection per rank."""

    def __init__(self, rank, size, share, local_only, timeout):
        """share(value) returns rank 0's value on every rank (a broadcast)."""
        self.rank, self.size = rank, size
        self._closing = False  # from now on a closed connection is no death
        self._lock = threading.Lock()
        if rank == 0:
            self._server, host = _listen(local_only, size)
            self._server.setblocking(False)
            self._secret = secrets.token_hex(16).encode()
            #: (host, port) where the hub listens, as the other ranks are told.
            self.address = (host, self._server.getsockname()[1])
            share(f"{host}:{self.address[1]} {self._secret.decode()}")
            self._peers = {}  # authenticated socket -> rank: the only ones told ABORT or BYE (under _lock)
            # The rest is the serve thread's alone.
            self._pending = {}  # socket -> deadline for its greeting, oldest first
            self._buffers = {}  # socket -> the start of a line not yet ended
            self._met = set()  # ranks that ever presented the secret
            self._noted = set()  # kinds of junk already reported on stderr
            self._done = threading.Event()
            self._wake_r, self._wake_w = socket.socketpair()
            self._sel = selectors.DefaultSelector()
            target = self._serve
        else:
            address, secret = share(None).split(" ")
            host, port = address.rsplit(":", 1)
            self._sock = socket.create_connection((host, int(port)), timeout=timeout)
            self._sock.settimeout(None)
            self._sock.sendall(f"HELLO {rank} {secret}\n".encode())
            target = self._watch
        self._thread = threading.Thread(target=target, name="spmd-hub", daemon=True)
        self._thread.start()

    # -- rank 0 ------------------------------------------------------------------

    def _serve(self):
        self._sel.register(self._server, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        while not self._done.is_set():
            self._step(0.25)
        self._finish()

    def _step(self, timeout):
        """Serve what is ready within timeout, then close connections past their greeting's deadline."""
        try:
            for key, _ in self._sel.select(timeout):
                conn = key.fileobj
                if conn is self._server:
                    self._accept()
                elif conn is self._wake_r:
                    self._wake_r.recv(64)
                elif conn in self._buffers:  # not closed earlier in this pass
                    self._serve_one(conn)
            self._expire()
        except Exception as exc:  # this thread must outlive anything it is sent
            self._note("error", f"the fail-fast hub recovered from {exc!r}")
            time.sleep(0.05)

    def _serve_one(self, conn):
        try:
            self._read(conn)
        except Exception as exc:  # one connection's trouble is that connection's end, not the loop's
            self._note("error", f"the fail-fast hub dropped a connection after {exc!r}")
            self._drop(conn)

    def _accept(self):
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, say: make room
                self._note("accept", f"the fail-fast hub could not accept a connection ({exc})")
                if self._pending:
                    self._evict()
                else:
                    time.sleep(0.05)  # not ours to free: do not spin on it
                return
            conn.setblocking(False)
            self._pending[conn] = time.monotonic() + HELLO_WITHIN  # this thread's alone, as _buffers
            self._buffers[conn] = b""
            self._sel.register(conn, selectors.EVENT_READ)
            while len(self._pending) > MAX_PENDING:
                self._note("flood", f"the fail-fast hub held {MAX_PENDING} connections that had not greeted it "
                                    "and closed the oldest")
                self._evict()

    def _evict(self):
        """Close the oldest unauthenticated connection, unless its greeting is waiting."""
        if not self._pending:
            return
        conn = next(iter(self._pending))
        self._serve_one(conn)  # a rank's HELLO may be there, unread
        if conn in self._pending:
            self._drop(conn)

    def _expire(self):
        now = time.monotonic()
        for conn, deadline in list(self._pending.items()):
            if deadline > now:
                break  # the rest came later
            self._note("slow", f"the fail-fast hub closed a connection that sent no greeting within {HELLO_WITHIN:g} s")
            self._drop(conn)

    def _read(self, conn):
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._lost(conn)
            return
        *lines, rest = (self._buffers[conn] + data).split(b"\n")
        for line in lines:
            if len(line) > MAX_LINE:
                self._drop(conn)
                return
            self._message(conn, line)
            if conn not in self._buffers:  # the message closed it
                return
        if len(rest) > MAX_LINE:
            self._drop(conn)
            return
        self._buffers[conn] = rest

    def _message(self, conn, line):
        rank = self._peers.get(conn)
        if rank is None:  # its first line, and the only one it may send: HELLO <rank> <secret>
            self._hello(conn, line)
        elif line == b"FAIL":
            self._abort_all(None)
        elif line == b"BYE":
            with self._lock:
                self._peers.pop(conn, None)
        else:
            self._note("word", f"the fail-fast hub ignored a message from rank {rank}: {line[:40]!r}")

    def _hello(self, conn, line):
        parts = line.split(b" ")
        if len(parts) != 3 or parts[0] != b"HELLO" or not parts[1].isdigit() or not 0 < int(parts[1]) < self.size:
            self._note("hello", f"the fail-fast hub closed a connection from {_peer(conn)} that did not "
                                "greet it as a rank does")
            self._drop(conn)
            return
        if not hmac.compare_digest(parts[2], self._secret):
            self._note("secret", f"the fail-fast hub closed a connection from {_peer(conn)} with a wrong secret")
            self._drop(conn)
            return
        rank = int(parts[1])
        self._pending.pop(conn, None)  # (a rank that said BYE is no longer pending)
        with self._lock:
            self._peers[conn] = rank
        self._met.add(rank)

    def _lost(self, conn):
        """The other end closed conn: a death if it was a rank that had not said BYE."""
        rank = self._peers.get(conn)
        self._drop(conn)
        if rank is not None and not self._closing:
            self._abort_all(
                f"rank {rank} of {self.size} died without reporting an error "
                "(killed by a signal, or exited without finalize)"
            )

    def _drop(self, conn):
        with self._lock:
            self._peers.pop(conn, None)
        self._pending.pop(conn, None)
        self._buffers.pop(conn, None)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _note(self, kind, text):
        """Say text on stderr, the first time something of this kind happens."""
        if kind in self._noted:
            return
        self._noted.add(kind)
        try:
            sys.stderr.write(f"### spmd: {text} (reported once; the job goes on)\n")
            sys.stderr.flush()
        except Exception:  # stderr closed: the hub serves on regardless
            pass

    def _tell_all(self, word):
        """Send word to every rank that presented the secret."""
        with self._lock:
            peers = list(self._peers)
        for conn in peers:
            try:
                conn.send(word)  # a few bytes into an empty buffer: never partial
            except OSError:
                pass

    def _abort_all(self, message):
        self._closing = True
        self._tell_all(b"ABORT\n")
        exit_now(PEER_EXIT, f"### spmd: {message}; ending the job" if message else None)

    def _finish(self):
        """Say BYE to every rank and close everything, once every rank's greeting is read."""
        # Under load a rank's greeting may not be read yet (its connection not even
        # accepted): one closed unread would read, on that rank, as rank 0's death.
        deadline = time.monotonic() + CLOSE_WAIT
        try:
            self._accept()
            while self._pending and len(self._met) < self.size - 1 and time.monotonic() < deadline:
                self._step(0.05)
            self._tell_all(b"BYE\n")
        finally:
            for conn in list(self._buffers):
                self._drop(conn)
            self._sel.close()
            for sock in (self._server, self._wake_r, self._wake_w):
                sock.close()

    # -- other ranks -------------------------------------------------------------

    def _watch(self):
        rest = b""
        while True:
            try:
                chunk = self._sock.recv(4096)
            except OSError:
                chunk = b""
            if not chunk:
                if not self._closing:
                    exit_now(PEER_EXIT, f"### spmd: rank {self.rank}: lost rank 0 (it died); ending")
                return
            *lines, rest = (rest + chunk).split(b"\n")
            for line in lines:
                if line == b"ABORT":
                    exit_now(PEER_EXIT)
                    return
                if line == b"BYE":
                    return
            if len(rest) > MAX_LINE:  # rank 0 never says anything that long
                rest = b""

    # -- both ------------------------------------------------------------------

    def fail(self):
        """Tell every rank that this one failed (it prints its own traceback)."""
        if self.rank == 0:
            self._closing = True
            self._tell_all(b"ABORT\n")
            return
        try:
            self._sock.sendall(b"FAIL\n")
        except OSError:
            pass

    def close(self):
        """Leave normally: the other side will not take it for a death."""
        self._closing = True
        if self.rank == 0:
            self._done.set()
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass
            self._thread.join(timeout=CLOSE_WAIT + 3.0)
        else:
            try:
                self._sock.sendall(b"BYE\n")
                self._sock.close()
            except OSError:
                pass


def _listen(local_only, size):
    """Bind the hub where the other ranks will be told to connect; return (socket, that address)."""
    backlog = max(size, socket.SOMAXCONN)
    if local_only:
        return socket.create_server(("127.0.0.1", 0), backlog=backlog), "127.0.0.1"
    host = socket.gethostname()
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        infos = []
    for family, _, _, _, sockaddr in infos:
        ip = ipaddress.ip_address(sockaddr[0].split("%")[0])
        if ip.is_loopback or ip.is_link_local:  # Debian maps the host name to 127.0.1.1
            continue
        try:
            return socket.create_server((str(ip), 0), family=family, backlog=backlog), str(ip)
        except OSError:
            continue
    # No address of this host's name can be bound: every interface, guarded by the secret alone.
    return socket.create_server(("", 0), backlog=backlog), host


def _peer(conn):
    try:
        return conn.getpeername()[0]
    except OSError:
        return "an unknown address"


class MpiTimeout:
    """Abort the job when an MPI call, or the wait() of an async one, has waited past the timeout.

    A monitor's ``busy`` is the number of the call its rank blocks in (set
    by ``Comm._call``, and by a handle's ``wait()``, which also sets
    ``waiting``); the same number seen for longer than the timeout ends the job.
    """

    def __init__(self, comm, monitors):
        # Not the communicator itself: this thread must never hold the last
        # reference to it, or the communicator's tensors are freed on this
        # thread, which aborts the process if that happens during interpreter
        # teardown ("terminate called without an active exception").
        self.rank, self.size, self.timeout = comm.rank, comm.size, comm.timeout
        self._monitors = monitors  # the world's monitor and its sub-communicators'
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spmd-timeout", daemon=True)
        self._thread.start()

    def _run(self):
        timeout = self.timeout
        period = min(1.0, timeout / 4)
        since = {}
        while not self._stop.wait(period):
            now = time.monotonic()
            for mon in list(self._monitors):
                busy, waiting = mon.busy, mon.waiting
                if not busy:
                    since.pop(id(mon), None)
                    continue
                first = since.get(id(mon))
                if first is None or first[0] != busy:
                    since[id(mon)] = (busy, now)
                elif now - first[1] > timeout:
                    in_wait = waiting is not None and waiting[0] == busy
                    fp = waiting if in_wait else mon.find(busy)  # an async call may be out of the ring
                    name = mon.name_of(fp) if fp else "a collective"
                    self._expire(mon, busy, name, in_wait)

    def _expire(self, mon, seq, name, in_wait=False):
        sys.stderr.write(
            f"### spmd: rank {self.rank} of {self.size}: {name} (call #{seq}) timed "
            f"out after {self.timeout:g} s {mon.IN_WAIT + ', ' if in_wait else ''}waiting for "
            f"{'its peer' if name.startswith(('send ', 'recv ')) else 'the other ranks'} "
            f"(mpi backend; where the others wait cannot be known). Last calls on this rank: {mon.recent()}. "
            "Ending the job.\n"
        )
        sys.stderr.flush()
        abort_job(1)  # MPI_Abort, once mpirun has had a moment to forward this

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5.0)  # it wakes at once; ended before the interpreter


def store_share(store, rank):
    """Return a share() for Hub that passes rank 0's value through a store."""

    def share(value):
        if rank == 0:
            store.set("spmd/hub", value)
            return value
        return store.get("spmd/hub").decode()

    return share
