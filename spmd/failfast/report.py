"""One report per job: how ranks' errors compare, and where every rank is at a hang.

``digest``: an error's type and message with rank numbers, pids and
addresses normalised, hashed, so that ranks that failed alike can tell
(the hub lets the lowest of them print it in full, the others one line).
``where``: this process's answer to the hub's ``STACKS``: its main
thread's innermost frame outside spmd and the standard library, the spmd
call in progress, and every thread's stack.  ``stacks_text``: the one
report made of every rank's answer, grouped.  ``SignalReport``: ``kill
-USR2`` on any rank asks for that report without ending the job.
"""

import hashlib
import os
import re
import select
import signal
import socket
import sys
import sysconfig
import threading
import traceback
from spmd.util.paths import is_spmd_file
from spmd.util.words import ranks_text

__all__ = ["digest", "normalise", "where", "stacks_text", "SignalReport", "MAX_THREADS_TEXT"]

_PATHS = sysconfig.get_paths()
_STDLIB = tuple(sorted({os.path.abspath(_PATHS[k]) + os.sep for k in ("stdlib", "platstdlib") if k in _PATHS}))
_SITE = tuple(sorted({os.path.abspath(_PATHS[k]) + os.sep for k in ("purelib", "platlib") if k in _PATHS}))

#: Characters of one rank's stacks of all threads that travel to the hub, at most.
MAX_THREADS_TEXT = 64 * 1024

# What differs between ranks that failed alike: rank numbers, pids, addresses, how many peers were seen.
_NORMAL = [
    (re.compile(r"\branks \[[\d, ]*\]"), "ranks [N]"),
    (re.compile(r"\b(rank|Rank|ranks|Ranks) \d+"), r"\1 N"),
    (re.compile(r"\bpid \d+"), "pid N"),
    (re.compile(r"\[[^\]\s]*\]:\d+"), "[ADDR]"),  # gloo's [127.0.0.1]:41234
    # what the backend said of a timeout: waiting to send on one rank, to receive on another
    (re.compile(r"\((gloo|nccl|mpi): [^()]*\)"), r"(\1: ...)"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "0xN"),
    (re.compile(r"(rank N in [^,;]+)(?:, \1)+"), r"\1"),  # the same peers' report, however many had come
]


def normalise(text):
    """Return text with what differs between ranks that failed alike replaced."""
    for pattern, replacement in _NORMAL:
        text = pattern.sub(replacement, text)
    return text


def digest(exc_type, exc):
    """Return a short hex digest of an error: its type and its normalised message."""
    name = f"{exc_type.__module__}.{exc_type.__qualname__}"
    try:
        message = str(exc)
    except Exception:  # a broken __str__ is still an error to report
        message = ""
    return hashlib.sha256(f"{name}: {normalise(message)}".encode("utf-8", "replace")).hexdigest()[:16]


# -- where this process is -------------------------------------------------------------

def _ours(path):
    """Tell whether a frame's file is spmd's own or the standard library's."""
    if path.startswith("<frozen"):  # before abspath, which would put it under the working directory
        return True
    path = os.path.abspath(path)
    if is_spmd_file(path):
        return True
    return path.startswith(_STDLIB) and not path.startswith(_SITE)


def _user_frame(frame):
    """Return the innermost frame outside spmd and the standard library (else the innermost one)."""
    f = frame
    while f is not None:
        if not _ours(f.f_code.co_filename):
            return f
        f = f.f_back
    return frame


def _in_finalize(frame):
    """Tell whether a stack is inside spmd's finalize (the script ran to its end)."""
    while frame is not None:
        if frame.f_code.co_name == "finalize" and is_spmd_file(frame.f_code.co_filename):
            return True
        frame = frame.f_back
    return False


def _show(path):
    """A path as a report shows it: relative to the working directory when below it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def _calls(monitors):
    """Name the spmd calls in progress in this process: 'all_reduce #12', or None."""
    from spmd.failfast.calls import call_name

    names = []
    for mon in list(monitors):
        busy = mon.busy
        if busy:
            fp = mon.find(busy)
            names.append(f"{call_name(fp) if fp else 'a call'} #{busy}")
    return ", ".join(names) or None


def _threads(frames):
    """Every thread's stack but the calling one's, as text."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me, main = threading.get_ident(), threading.main_thread().ident
    parts = []
    for ident, frame in sorted(frames.items(), key=lambda kv: kv[0] != main):
        if ident == me:
            continue
        parts.append(f"Thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)))
    text = "".join(parts)
    if len(text) > MAX_THREADS_TEXT:
        text = text[:MAX_THREADS_TEXT] + "\n... (cut)\n"
    return text


def where(rank, monitors=()):
    """Return this process's summary for the hub: rank, host, pid, where, func, call, threads."""
    frames = sys._current_frames()
    main = frames.get(threading.main_thread().ident)
    frame = _user_frame(main)
    if frame is None:
        place, func = "?", "?"
    elif _ours(frame.f_code.co_filename) and _in_finalize(main):  # no frame of the user's: the script is over
        place, func = "the end of its script", "spmd.finalize"
    else:
        place, func = f"{_show(frame.f_code.co_filename)}:{frame.f_lineno}", frame.f_code.co_name
    return {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "where": place, "func": func,
            "call": _calls(monitors), "threads": _threads(frames)}


# -- the report made of every rank's summary ---------------------------------------------

def _line(ranks, size, call, place, func):
    if len(ranks) == 1:
        who, verb = f"rank {ranks[0]}", ("waits" if call else "is")
    else:
        who, verb = f"{len(ranks)} of {size} ranks", ("wait" if call else "are")
    text = f"{who} {verb} in {call} at {place}" if call else f"{who} {verb} at {place} in {func}()"
    return text + (f" ({ranks_text(ranks)})" if len(ranks) > 1 else "")


def stacks_text(summaries, size, asked="", waited=None):
    """Return the one report of where every rank is, from {rank: where()} (some ranks may be missing)."""
    groups = {}
    for rank in sorted(summaries):
        s = summaries[rank]
        key = (s.get("call"), s.get("where", "?"), s.get("func", "?"))
        groups.setdefault(key, []).append(rank)
    order = sorted(groups.items(), key=lambda kv: (kv[0][0] is None, -len(kv[1]), kv[1][0]))
    lines = [_line(ranks, size, *key) for key, ranks in order]
    missing = [r for r in range(size) if r not in summaries]
    if missing:
        lines.append(f"{ranks_text(missing)} did not answer"
                     + (f" within {waited:g} s" if waited else ""))
    head = f"### spmd: where the {size} ranks are" + (f" ({asked})" if asked else "") + ":\n"
    out = [head, "### spmd:   " + ";\n### spmd:   ".join(lines) + "\n"]
    stacks = {}
    for rank in sorted(summaries):
        stacks.setdefault(summaries[rank].get("threads", ""), []).append(rank)
    out.append("### spmd: the stacks of every thread, by rank (identical stacks shown once):\n")
    for text, ranks in sorted(stacks.items(), key=lambda kv: kv[1][0]):
        first = summaries[ranks[0]]
        out.append(f"--- {ranks_text(ranks)} (rank {ranks[0]}: {first.get('host', '?')}, pid {first.get('pid', '?')}) ---\n")
        out.append(text if text.endswith("\n") or not text else text + "\n")
    out.append("### spmd: end of the stacks\n")
    return "".join(out)


# -- kill -USR2 ---------------------------------------------------------------------------

class SignalReport:
    """On SIGUSR2, call trigger() from a thread of its own (the main thread may be stuck in C)."""

    def __init__(self, trigger, signum=signal.SIGUSR2):
        """Install only from the main thread and only over the default disposition; else do nothing."""
        self.signum, self._trigger = signum, trigger
        self.installed = False
        self._fds = None
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signum) not in (signal.SIG_DFL, None):
            return  # the user's own handler: left alone
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        # Python runs a handler only in the main thread, between bytecodes: never while it
        # waits in MPI or gloo.  The wakeup fd is written by the C-level handler at once.
        signal.signal(signum, self._handler)
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        if previous != -1:  # someone's (asyncio's) already: theirs stays, the handler alone serves
            signal.set_wakeup_fd(previous)
            os.close(r)
            os.close(w)
        else:
            self._fds = (r, w)
            self._stop_r, self._stop_w = os.pipe()
            self._thread = threading.Thread(target=self._run, name="spmd-signal", daemon=True)
            self._thread.start()
        self.installed = True

    def _handler(self, signum, frame):
        if self._fds is None:
            self._fire()

    def _fire(self):
        try:
            self._trigger()
        except Exception:  # a report on demand never ends the job
            pass

    def _run(self):
        r = self._fds[0]
        while True:
            ready, _, _ = select.select([r, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            try:
                data = os.read(r, 512)
            except (BlockingIOError, InterruptedError):
                continue
            # Other signals with Python handlers (SIGINT) write here too; a handler the
            # script installed later for this one is the script's business alone.
            if self.signum in data and signal.getsignal(self.signum) == self._handler:
                self._fire()

    def close(self):
        """Put back the default disposition and the wakeup fd (from the main thread only)."""
        if not self.installed:
            return
        self.installed = False
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may: the handler stays, harmless, and so do its fds
        if signal.getsignal(self.signum) == self._handler:
            signal.signal(self.signum, signal.SIG_DFL)
        if self._fds is None:
            return
        current = signal.set_wakeup_fd(-1)
        if current != self._fds[1]:
            signal.set_wakeup_fd(current)  # not ours any more: put it back
        os.write(self._stop_w, b"x")
        self._thread.join(timeout=2.0)
        for fd in (*self._fds, self._stop_r, self._stop_w):
            os.close(fd)
        self._fds = None
