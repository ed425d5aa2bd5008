"""Job-wide fail-fast and collective timeouts that no backend gives for free.

``Hub``: every rank keeps one TCP connection to a small hub in rank 0.  A rank that fails says so on its connection; a
rank that dies without a word (SIGKILL, os._exit) shows up as the
connection closing.  Either way the hub tells every rank to exit at once,
so nobody waits for the collective timeout, whatever the launcher.  Only
connections that open with the job's secret count (see docs/reliability.md,
"The hub's threat model"): anything else that connects is dropped, and no
input ends the hub's thread.

It also makes one report of what every rank says: a failing rank asks it
whether to print its error in full (``judge``: the lowest rank with that
error does, the others print one line), and any rank can ask where every
rank is (``stacks_report``: at a timeout, or on SIGUSR2), which rank 0
prints once.

``MpiTimeout``: MPI collectives cannot be interrupted, so a thread watches
the collective in progress and, past the timeout, prints which collective
this rank was waiting in and aborts the job.
"""

import collections
import hmac
import ipaddress
import json
import re
import secrets
import selectors
import socket
import sys
import threading
import time

from spmd.failfast import report
from spmd.failfast.abort import PEER_EXIT, abort_job, exit_now, report_message, stacks_report  # PEER_EXIT, exit_now: also spmd.failfast.hub's

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
#: Seconds the hub collects failures after the first one before it says which rank prints each in full.
WINDOW = 0.4
#: Seconds a failing rank waits for that answer; without one it prints in full.
ANSWER_WAIT = 2.0
#: Seconds an ABORT waits for this rank's own report to be written.
REPORT_WAIT = 3.0
#: Bytes of one rank's answer to STACKS, and of the report sent back to a rank that asked, at most.
MAX_STACK = 256 * 1024
MAX_REPORT = 1024 * 1024
#: Seconds a report of stacks asked for at a timeout serves the timeouts that follow it.
REUSE = 10.0
#: Why a rank may ask for the stacks report (WHERE <reason> <milliseconds>), as the report says it.
REASONS = {b"timeout": "a call timed out on rank {}", b"signal": "SIGUSR2 on rank {}"}

_HEX = re.compile(rb"[0-9a-f]{1,64}")


class Hub:
    """Rank 0's relay of failures; one persistent, authenticated connection per rank.

    A rank says HELLO <rank> <secret> first, then FAIL, BYE, ERR <digest>
    (judge), WHERE <reason> <ms> (stacks_report) or STACK <n> and n bytes
    (its answer to STACKS); rank 0 says ABORT, BYE, FULL, SAME <rank>,
    STACKS or REPORT <n> and n bytes.  Lines are at most MAX_LINE bytes.
    """

    def __init__(self, rank, size, share, local_only, timeout, monitors=()):
        """share(value) returns rank 0's value on every rank (a broadcast); monitors: this rank's, for STACKS."""
        self.rank, self.size = rank, size
        self.monitors = monitors
        self._closing = False  # from now on a closed connection is no death
        self._lock = threading.Lock()
        self._reporting = threading.Event()  # this rank asked judge(): an ABORT waits for its report
        self._printed = threading.Event()  # ... and it is written
        self._ending = False  # an ABORT is waiting for that
        self._verdict = [None, threading.Event()]  # judge()'s answer: the rank that prints in full
        if rank == 0:
            self._server, host = _listen(local_only, size)
            self._server.setblocking(False)
            self._secret = secrets.token_hex(16).encode()
            #: (host, port) where the hub listens, as the other ranks are told.
            self.address = (host, self._server.getsockname()[1])
            share(f"{host}:{self.address[1]} {self._secret.decode()}")
            self._peers = {}  # authenticated socket -> rank: the only ones told ABORT or BYE (under _lock)
            self._write_lock = threading.Lock()  # one writer at a time on those sockets (_write)
            # The rest is the serve thread's alone.
            self._pending = {}  # socket -> deadline for its greeting, oldest first
            self._buffers = {}  # socket -> the start of a line not yet ended
            self._met = set()  # ranks that ever presented the secret
            self._noted = set()  # kinds of junk already reported on stderr
            self._expect = {}  # socket -> bytes of the STACK answer still to come on it
            self._requests = collections.deque()  # rank 0's own judge and WHERE, for the serve thread
            self._errors = {}  # rank -> (digest, its socket or None): failures waiting for the window's end
            self._window_end = None
            self._leads = {}  # digest -> the rank that prints it in full
            self._gather = None  # the STACKS in progress: see _ask_stacks
            self._last = None  # (when, text) of the last stacks report
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
            self._send_lock = threading.Lock()
            self._report = [None, threading.Event()]  # the stacks report rank 0 sent back
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
            now = time.monotonic()
            for deadline in (self._window_end if self._errors else None,
                             self._gather["deadline"] if self._gather else None):
                if deadline is not None:
                    timeout = max(0.0, min(timeout, deadline - now))
            for key, _ in self._sel.select(timeout):
                conn = key.fileobj
                if conn is self._server:
                    self._accept()
                elif conn is self._wake_r:
                    self._wake_r.recv(64)
                elif conn in self._buffers:  # not closed earlier in this pass
                    self._serve_one(conn)
            while self._requests:
                self._local(self._requests.popleft())
            self._expire()
            self._tick()
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
        buf, at = self._buffers[conn] + data, 0
        while True:
            want = self._expect.get(conn)
            if want is not None:  # a rank's answer to STACKS: want bytes, not a line
                if len(buf) - at < want:
                    break
                del self._expect[conn]
                self._stack(conn, buf[at:at + want])
                at += want
            else:
                end = buf.find(b"\n", at)
                if end < 0:
                    break
                if end - at > MAX_LINE:
                    self._drop(conn)
                    return
                line, at = buf[at:end], end + 1
                self._message(conn, line)
            if conn not in self._buffers:  # the message closed it
                return
        rest = buf[at:]
        if len(rest) > MAX_LINE and conn not in self._expect:
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
        elif not self._word(conn, rank, line.split(b" ")):
            self._note("word", f"the fail-fast hub ignored a message from rank {rank}: {line[:40]!r}")

    def _word(self, conn, rank, parts):
        """Act on ERR, WHERE or STACK from an authenticated rank; tell whether it was one of them."""
        if len(parts) == 2 and parts[0] == b"ERR" and _HEX.fullmatch(parts[1]):
            self._judge(rank, parts[1].decode(), conn)
        elif len(parts) == 3 and parts[0] == b"WHERE" and parts[1] in REASONS and parts[2].isdigit():
            self._ask_stacks(rank, parts[1], min(int(parts[2]), 60000) / 1000, conn)
        elif len(parts) == 2 and parts[0] == b"STACK" and parts[1].isdigit() and 0 < int(parts[1]) <= MAX_STACK:
            self._expect[conn] = int(parts[1])
        else:
            return False
        return True

    def _local(self, request):
        """Serve a request of rank 0's own, made on another thread."""
        kind, *args = request
        if kind == "judge":
            self._judge(0, args[0], None)
        else:
            self._ask_stacks(0, *args)

    # -- one report per job (rank 0) -------------------------------------------

    def _judge(self, rank, digest, conn):
        """Rank failed with this digest: answer at the window's end, or at once once it has passed."""
        now = time.monotonic()
        if self._window_end is None:
            self._window_end = now + WINDOW
        if now < self._window_end:
            self._errors[rank] = (digest, conn)
        else:
            self._answer(rank, conn, self._leads.setdefault(digest, rank))

    def _tick(self):
        """Answer the failures once the window has passed; end a gather past its deadline."""
        now = time.monotonic()
        if self._errors and now >= self._window_end:
            errors, self._errors = self._errors, {}
            for rank in sorted(errors):
                digest, conn = errors[rank]
                self._answer(rank, conn, self._leads.setdefault(digest, rank))  # the lowest first
        if self._gather is not None and now >= self._gather["deadline"]:
            self._end_gather()

    def _answer(self, rank, conn, lead):
        if conn is None:
            self._verdict[0] = lead
            self._verdict[1].set()
            return
        self._write(conn, b"FULL\n" if lead == rank else f"SAME {lead}\n".encode())

    # -- where every rank is (rank 0) ------------------------------------------

    def _ask_stacks(self, rank, reason, wait, waiter):
        """Rank asked where every rank is: ask each (once for every asker now), answer waiter at the end.

        reason: a key of REASONS; waiter: the asker's socket, a local [text, Event] slot, or None.
        """
        now = time.monotonic()
        if self._gather is None and reason == b"timeout" and self._last and now - self._last[0] < REUSE:
            self._reply(waiter, self._last[1])  # one hang, one report: the first timeout's
            return
        if self._gather is None:
            self._gather = {"asked": REASONS[reason].format(rank), "wait": wait, "deadline": now + wait, "waiters": [],
                            "got": {0: report.where(0, self.monitors)}}
            self._tell_all(b"STACKS\n")
        self._gather["waiters"].append(waiter)
        self._maybe_end_gather()

    def _stack(self, conn, payload):
        """A rank's answer to STACKS."""
        rank = self._peers.get(conn)
        if self._gather is None or rank is None:
            return
        try:
            summary = json.loads(payload.decode("utf-8", "replace"))
        except ValueError:
            self._note("stack", f"the fail-fast hub could not read rank {rank}'s stacks")
            return
        if isinstance(summary, dict):
            self._gather["got"][rank] = {k: str(v)[:MAX_STACK] if v is not None else None
                                         for k, v in summary.items() if isinstance(k, str)}
        self._maybe_end_gather()

    def _maybe_end_gather(self):
        if self._gather is not None and len(self._gather["got"]) >= self.size:
            self._end_gather()

    def _end_gather(self):
        gather, self._gather = self._gather, None
        text = report.stacks_text(gather["got"], self.size, gather["asked"], gather["wait"])
        self._last = (time.monotonic(), text)
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except Exception:
            pass
        for waiter in gather["waiters"]:
            self._reply(waiter, text)

    def _reply(self, waiter, text):
        if waiter is None:
            return
        if isinstance(waiter, list):
            waiter[0] = text
            waiter[1].set()
            return
        data = text.encode("utf-8", "replace")[:MAX_REPORT]
        self._write(waiter, b"REPORT %d\n" % len(data) + data, 2.0)  # its watch thread reads at once

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
        self._expect.pop(conn, None)
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
            self._write(conn, word)

    def _write(self, conn, data, seconds=1.0):
        """Send data whole on one of rank 0's connections, from any thread, within seconds.

        One writer at a time: the main thread's ABORT (fail) must not land
        inside a REPORT the serve thread is sending on the same socket.
        """
        with self._write_lock:
            try:
                conn.settimeout(seconds)
                conn.sendall(data)
            except OSError:
                pass
            finally:
                try:
                    conn.setblocking(False)  # the serve thread's reads never wait
                except OSError:
                    pass

    def _abort_all(self, message):
        self._closing = True
        self._tell_all(b"ABORT\n")
        self._end(PEER_EXIT, f"### spmd: {message}; ending the job" if message else None)

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
        buf, want = b"", None  # want: bytes of a REPORT still to come
        while True:
            try:
                chunk = self._sock.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                self._verdict[1].set()  # no answer will come: print in full
                self._report[1].set()
                if not self._closing:
                    exit_now(PEER_EXIT, f"### spmd: rank {self.rank}: lost rank 0 (it died); ending")
                return
            buf, at = buf + chunk, 0
            while True:
                if want is not None:
                    if len(buf) - at < want:
                        break
                    self._report[0] = buf[at:at + want].decode("utf-8", "replace")
                    self._report[1].set()
                    at, want = at + want, None
                    continue
                end = buf.find(b"\n", at)
                if end < 0:
                    break
                line, at = buf[at:end], end + 1
                if line == b"BYE":
                    return
                want = self._heard(line)
            buf = buf[at:]
            if want is None and len(buf) > MAX_LINE:  # rank 0 never says anything that long
                buf = b""

    def _heard(self, line):
        """Act on a line from rank 0; return the length of the REPORT that follows it, if one does."""
        parts = line.split(b" ")
        if line == b"ABORT":
            self._closing = True
            self._end(PEER_EXIT)
        elif line == b"FULL" or len(parts) == 2 and parts[0] == b"SAME" and parts[1].isdigit():
            self._verdict[0] = self.rank if line == b"FULL" else int(parts[1])
            self._verdict[1].set()
        elif line == b"STACKS":
            data = json.dumps(report.where(self.rank, self.monitors)).encode()
            if len(data) > MAX_STACK:  # cut the threads' part, never the summary
                summary = report.where(self.rank, self.monitors)
                summary["threads"] = summary["threads"][:MAX_STACK // 4] + "\n... (cut)\n"
                data = json.dumps(summary).encode()[:MAX_STACK]
            self._send(b"STACK %d\n" % len(data) + data)
        elif len(parts) == 2 and parts[0] == b"REPORT" and parts[1].isdigit() and int(parts[1]) <= MAX_REPORT:
            return int(parts[1])
        return None

    def _send(self, data):
        with self._send_lock:
            try:
                self._sock.sendall(data)
                return True
            except OSError:
                return False

    # -- both ------------------------------------------------------------------

    def _end(self, code, message=None):
        """End this process, once its own report (if it is writing one) is written."""
        if not self._reporting.is_set() or self._printed.is_set():
            exit_now(code, message)
            return
        if self._ending:
            return
        self._ending = True

        def later():
            self._printed.wait(REPORT_WAIT)
            exit_now(code, message)

        threading.Thread(target=later, name="spmd-end", daemon=True).start()

    def judge(self, digest, timeout=ANSWER_WAIT):
        """This rank failed with an error of this digest: return the rank that prints it in full.

        That is the lowest rank that failed alike within the hub's window,
        this one's if so; None when no answer came in time (print in full).
        Call judged() once the report is written.
        """
        self._reporting.set()
        if self.rank == 0:
            self._requests.append(("judge", digest))
            self._wake()
        elif not self._send(f"ERR {digest}\n".encode()):
            return None
        if not self._verdict[1].wait(timeout):
            return None
        return self._verdict[0]

    def judged(self):
        """This rank's report is written: an ABORT may end it now."""
        self._printed.set()

    def stacks_report(self, timeout=2.0, reason="timeout"):
        """Ask every rank where it is; rank 0 prints one report; return its text (None if none came).

        timeout: seconds the hub waits for the ranks' answers.  reason:
        "timeout" (a call timed out here: a report made for an earlier
        timeout in the last few seconds is reused) or "signal".
        """
        wait = max(0.1, float(timeout))
        if self.rank == 0:
            slot = [None, threading.Event()]
            self._requests.append(("stacks", reason.encode(), wait, slot))
            self._wake()
            slot[1].wait(wait + 2.0)
            return slot[0]
        self._report[0] = None
        self._report[1].clear()
        if not self._send(f"WHERE {reason} {int(wait * 1000)}\n".encode()):
            return None
        self._report[1].wait(wait + 2.0)
        return self._report[0]

    def ask_stacks(self):
        """Ask for the stacks report without waiting (SIGUSR2's trigger: rank 0 prints it)."""
        if self.rank == 0:
            self._requests.append(("stacks", b"signal", 2.0, None))
            self._wake()
        else:
            self._send(b"WHERE signal 2000\n")

    def _wake(self):
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def fail(self):
        """Tell every rank that this one failed (it prints its own traceback)."""
        if self.rank == 0:
            self._closing = True
            self._tell_all(b"ABORT\n")
            return
        self._send(b"FAIL\n")

    def close(self):
        """Leave normally: the other side will not take it for a death."""
        self._closing = True
        if self.rank == 0:
            self._done.set()
            self._wake()
            self._thread.join(timeout=CLOSE_WAIT + 3.0)
        else:
            self._send(b"BYE\n")
            try:
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
                    fp = mon.find(busy)  # (an async call's wait: found though out of the ring)
                    name = mon.name_of(fp) if fp else "a collective"
                    self._expire(mon, busy, name, in_wait)

    def _expire(self, mon, seq, name, in_wait=False):
        # Where every rank is, gathered by the hub while the ranks still wait (rank 0 prints it).
        where = "see the report of every rank's stack" if stacks_report() else "where the others wait cannot be known"
        message = (
            f"### spmd: rank {self.rank} of {self.size}: {name} (call #{seq}) timed "
            f"out after {self.timeout:g} s {mon.IN_WAIT + ', ' if in_wait else ''}waiting for "
            f"{'its peer' if name.startswith(('send ', 'recv ')) else 'the other ranks'} "
            f"(mpi backend; {where}). Last calls on this rank: {mon.recent()}. Ending the job."
        )
        # One report per job: a rank whose timeout a lower rank reports alike prints one line.
        abort_job(1, after=report_message(message))  # MPI_Abort, once mpirun has had a moment to forward it

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
