"""Whole lines on stdout and stderr under every launcher: ``install``.

Under mpirun and torchrun every rank writes into one pipe or file, and an
unbuffered ``print`` writes its text and its newline apart, so lines of different
ranks run into each other.  ``install`` puts a text stream over the same file
descriptor in place of ``sys.stdout`` and ``sys.stderr`` that hands the kernel
whole lines only, one ``os.write`` each, several together up to ``PIPE_BUF``
bytes, optionally prefixed with ``[rank] ``.  What it guarantees: docs/reference.md
("Output lines").
"""

import io
import os
import select
import sys
import threading

__all__ = ["install", "whole_lines", "installed", "prefix", "PIPE_BUF", "HOLD"]

#: Bytes a pipe writes at once, never interleaved with another writer's (4096 on Linux).
PIPE_BUF = getattr(select, "PIPE_BUF", 4096)
#: Bytes of a line without its newline held back at most; more go out as they are.
HOLD = 1 << 16


def prefix(rank, size):
    """Return the tag of rank's lines, as spmd run writes it: '[ 3] ' in a world of 12."""
    return f"[{rank:>{len(str(size - 1))}}] "


class _Lines(io.BufferedIOBase):
    """The bytes under a whole-line text stream: writes whole lines to fd, holds the rest.

    lines: the text layer above flushes at each newline (line-buffered),
    so flush() writes nothing more; otherwise flush() writes the partial
    line too.  drain() always does.
    """

    # TextIOWrapper reads `closed` at every write: IOBase's property costs a print 30%,
    # so a class attribute.
    closed = False

    def __init__(self, fd, name, tag=b"", lines=True):
        super().__init__()
        self.name = name
        self._fd, self._tag, self._lines = fd, tag, lines
        self._tail = b""  # the line begun and not yet ended
        self._fresh = True  # the next byte starts a line (and so its tag)
        self._lock = threading.RLock()
        self._busy = False

    def writable(self):
        return True

    def fileno(self):
        return self._fd

    def isatty(self):
        return os.isatty(self._fd)

    def write(self, b):
        """Write every whole line of tail + b now; hold what follows the last newline."""
        self._checkClosed()  # io's own ValueError
        if b[-1:] == b"\n" and len(b) <= PIPE_BUF and not (self._tail or self._tag or self._busy):
            self._send(b)  # the common case, one print's line: no copy, no lock
            return len(b)
        data = bytes(b)
        with self._lock:
            if self._busy:  # a signal handler's print within a write of ours: out as it is
                self._send(data)
                return len(data)
            self._busy = True
            try:
                data = self._tail + data
                end = data.rfind(b"\n") + 1
                if end == 0 and len(data) <= HOLD:
                    self._tail = data
                    return len(b)
                if end == 0:
                    end = len(data)
                self._tail = data[end:]
                self._emit(data[:end])
            finally:
                self._busy = False
        return len(b)

    def flush(self):
        """Write the partial line, unless the text layer flushes at each newline (then: nothing)."""
        self._checkClosed()
        if not self._lines:
            self.drain()

    def drain(self):
        """Write the partial line held back, if any."""
        with self._lock:
            if self._tail and not self._busy:
                data, self._tail = self._tail, b""
                self._busy = True
                try:
                    self._emit(data)
                finally:
                    self._busy = False

    def close(self):
        """Write what is held; the file descriptor stays open (sys.__stdout__ owns it)."""
        if not self.closed:
            try:
                self.drain()
            finally:
                super().close()
                self.closed = True

    def _emit(self, data):
        if self._tag:
            data = self._tagged(data)
        n, start = len(data), 0
        while n - start > PIPE_BUF:  # cut at newlines into writes a pipe keeps whole
            stop = data.rfind(b"\n", start, start + PIPE_BUF) + 1
            if stop <= start:  # one line longer than PIPE_BUF: all of it, in one write
                stop = data.find(b"\n", start + PIPE_BUF) + 1 or n
            self._send(data[start:stop])
            start = stop
        if start < n:
            self._send(data[start:] if start else data)

    def _tagged(self, data):
        tag = self._tag
        text = data.replace(b"\n", b"\n" + tag)
        if self._fresh:
            text = tag + text
        self._fresh = data.endswith(b"\n")
        return text[:-len(tag)] if self._fresh else text

    def _send(self, data):
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]


class _Text(io.TextIOWrapper):
    """A line-buffered sys.stdout or sys.stderr over _Lines: flush() also writes a partial line.

    (TextIOWrapper's own flush at each newline calls the buffer's flush, which does not.)
    """

    closed = False  # read at every write: see _Lines
    mode = "w"  # as sys.stdout's

    def flush(self):
        super().flush()
        self.buffer.drain()

    def close(self):
        try:
            super().close()
        finally:
            self.closed = True


def _replace(stream, tag):
    """Return a whole-line stream over stream's file descriptor, or None to leave it.

    A line-buffered or unbuffered stream (a terminal, PYTHONUNBUFFERED) gets a
    line-buffered one, a block-buffered stream a plain TextIOWrapper, whose
    flush() calls the buffer's only when asked to.
    """
    if not isinstance(stream, io.TextIOWrapper):
        return None
    try:
        if isinstance(stream.buffer, _Lines):
            return None
        fd = stream.fileno()
    except (OSError, ValueError):  # detached, closed, or no file descriptor
        return None
    line = stream.line_buffering or stream.write_through
    stream.flush()
    buffer = _Lines(fd, getattr(stream, "name", fd), tag.encode(), lines=line)
    kind = _Text if line else io.TextIOWrapper
    new = kind(buffer, encoding=stream.encoding, errors=stream.errors, newline="\n",
               line_buffering=line)
    return new  # no `mode` on a plain TextIOWrapper: its own dictionary costs a print 5-10%


def install(rank, size, tag=False):
    """Make sys.stdout and sys.stderr write whole lines (tagged '[rank] ' if tag); return which.

    Only the process's own streams are replaced (not one that a test or
    contextlib.redirect_stdout put in their place), and only once.
    """
    text = prefix(rank, size) if tag else ""
    done = []
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not getattr(sys, f"__{name}__"):
            continue
        new = _replace(stream, text)
        if new is not None:
            setattr(sys, name, new)
            done.append(name)
    return done


def installed():
    """Tell whether sys.stdout writes whole lines."""
    return isinstance(getattr(sys.stdout, "buffer", None), _Lines)


def whole_lines(environ, tag=None):
    """Install whole lines for this rank when its world has several ranks, or when asked to tag.

    tag: prefix each line with '[rank] '; None reads SPMD_TAG_OUTPUT.
    """
    from spmd.config.placement import detect
    from spmd.config.settings import parse_tag_output

    placement = detect(environ)
    tag = parse_tag_output(environ) if tag is None else tag
    if placement.size == 1 and not tag:
        return []
    return install(placement.rank, placement.size, tag)
