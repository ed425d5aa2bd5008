"""Job-wide fail-fast and collective timeouts that no backend gives for free.

``Hub``: every rank keeps one TCP connection to a small hub in rank 0.  A rank that fails says so on its connection; a
rank that dies without a word (SIGKILL, os._exit) shows up as the
connection closing.  Either way the hub tells every rank to exit at once,
so nobody waits for the collective timeout, whatever the launcher.

``MpiTimeout``: MPI collectives cannot be interrupted, so a thread watches
the collective in progress and, past the timeout, prints which collective
this rank was waiting in and aborts the job.
"""

import selectors
import socket
import sys
import threading
import time

from .abort import PEER_EXIT, abort_job, exit_now  # PEER_EXIT, exit_now: also spmd.watchdog's, as before

__all__ = ["Hub", "MpiTimeout", "exit_now", "store_share", "PEER_EXIT"]


class Hub:
    """Rank 0's relay of failures; one persistent connection per rank."""

    def __init__(self, rank, size, share, local_only, timeout):
        """share(value) returns rank 0's value on every rank (a broadcast)."""
        self.rank, self.size = rank, size
        self._closing = False
        self._lock = threading.Lock()
        if rank == 0:
            self._server = socket.create_server(("", 0))
            host = "127.0.0.1" if local_only else socket.gethostname()
            share(f"{host}:{self._server.getsockname()[1]}")
            self._peers = {}  # socket -> rank
            self._accepted = []  # every connection, whether its HELLO was read yet or not
            target = self._serve
        else:
            host, port = share(None).rsplit(":", 1)
            self._sock = socket.create_connection((host, int(port)), timeout=timeout)
            self._sock.settimeout(None)
            self._sock.sendall(f"HELLO {rank}\n".encode())
            target = self._watch
        self._thread = threading.Thread(target=target, name="spmd-hub", daemon=True)
        self._thread.start()

    # -- rank 0 ------------------------------------------------------------------

    def _serve(self):
        sel = selectors.DefaultSelector()
        sel.register(self._server, selectors.EVENT_READ)
        buffers = {}
        while not self._closing:
            for key, _ in sel.select(timeout=0.5):
                if key.fileobj is self._server:
                    try:
                        conn = self._accept()
                    except OSError:  # taken by close(), or the server is closed
                        continue
                    buffers[conn] = b""
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                conn = key.fileobj
                try:
                    data = conn.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(conn)
                    rank = self._peers.pop(conn, None)
                    if rank is not None and not self._closing:
                        self._abort_all(
                            f"rank {rank} of {self.size} died without reporting an error "
                            "(killed by a signal, or exited without finalize)"
                        )
                    continue
                buffers[conn] += data
                while b"\n" in buffers[conn]:
                    line, buffers[conn] = buffers[conn].split(b"\n", 1)
                    self._message(conn, line.decode(errors="replace"))

    def _message(self, conn, line):
        word, _, rest = line.partition(" ")
        if word == "HELLO":
            self._peers[conn] = int(rest)
        elif word == "BYE":
            self._peers.pop(conn, None)
        elif word == "FAIL":
            self._abort_all(None)

    def _accept(self):
        conn, _ = self._server.accept()
        with self._lock:
            self._accepted.append(conn)
        return conn

    def _tell_all(self, word):
        """Send word to every connection, those whose HELLO this thread has not read yet included."""
        with self._lock:
            for conn in list(self._accepted):
                try:
                    conn.sendall(word)
                except OSError:
                    pass

    def _abort_all(self, message):
        self._tell_all(b"ABORT\n")
        exit_now(PEER_EXIT, f"### spmd: {message}; ending the job" if message else None)

    # -- other ranks -------------------------------------------------------------

    def _watch(self):
        data = b""
        while True:
            try:
                chunk = self._sock.recv(4096)
            except OSError:
                chunk = b""
            if not chunk:
                if not self._closing:
                    exit_now(PEER_EXIT, f"### spmd: rank {self.rank}: lost rank 0 (it died); ending")
                return
            data += chunk
            if b"ABORT" in data:
                exit_now(PEER_EXIT)
            if b"BYE" in data:
                return

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
            # Under load the serve thread may not have accepted every rank yet: a
            # connection closed unaccepted would read, on its rank, as rank 0's death.
            self._server.setblocking(False)
            while True:
                try:
                    self._accept()
                except OSError:
                    break
            self._tell_all(b"BYE\n")
            self._server.close()
        else:
            try:
                self._sock.sendall(b"BYE\n")
                self._sock.close()
            except OSError:
                pass


class MpiTimeout:
    """Abort the job when an MPI collective has waited past the timeout."""

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
                busy = mon.busy
                if not busy:
                    since.pop(id(mon), None)
                    continue
                first = since.get(id(mon))
                if first is None or first[0] != busy:
                    since[id(mon)] = (busy, now)
                elif now - first[1] > timeout:
                    fp = mon.find(busy)
                    name = mon.name_of(fp) if fp else "a collective"
                    self._expire(mon, busy, name)

    def _expire(self, mon, seq, name):
        sys.stderr.write(
            f"### spmd: rank {self.rank} of {self.size}: {name} (call #{seq}) timed "
            f"out after {self.timeout:g} s waiting for {'its peer' if name.startswith(('send ', 'recv ')) else 'the other ranks'} "
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
