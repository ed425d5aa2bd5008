"""Atomic file writes: a final output is either absent, the old file, or the new one, never a piece.

A writer fills ``.<target name>.spmd-tmp-<host>-<pid>-<random>`` in the target's
directory, fsyncs it, renames it onto the target (``os.replace``; ``os.link`` for
``exclusive=True``) and fsyncs the directory; an exception removes it.  The next
write of a target removes the temporaries that dead processes of this host left
(saying so once on stderr).  The guarantees and their limits: docs/reliability.md
("Nothing lost").

    with atomic_write("out.json", text=True) as f: json.dump(doc, f)
    with atomic_path("plot.png") as tmp: fig.savefig(tmp, format="png")
    out = AtomicFile("big.npy"); out.file.write(header); ...; out.commit()
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import socket
import sys

__all__ = ["AtomicFile", "atomic_write", "atomic_path", "temporary_name", "stale_temporaries",
           "remove_stale", "fsync_dir", "MARK"]

MARK = ".spmd-tmp-"


def _host():
    """This host's name as it appears in temporaries (no path separators, no spaces)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "localhost"


def _prefix(name):
    """The start of every temporary of the file called name on this host.

    A long name is cut so that the temporary's name stays under 255
    bytes (pid and random part: at most 30 more).
    """
    tail = f"{MARK}{_host()}-"
    room = max(1, 255 - 31 - len(tail.encode()))
    stem = name.encode()[:room].decode(errors="ignore")
    return f".{stem}{tail}"


def temporary_name(path, pid=None):
    """Return the path of a new temporary for path: same directory, spmd's mark, host and pid."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    pid = os.getpid() if pid is None else pid
    return os.path.join(folder, f"{_prefix(name)}{pid}-{secrets.token_hex(4)}")


def _alive(pid):
    """Tell whether pid is a live process on this host (a zombie counts as alive)."""
    if pid <= 0:
        return True  # not a pid spmd wrote: never touch it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def stale_temporaries(path):
    """Return the temporaries of path left by dead processes of this host, as (path, pid) pairs."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    prefix = _prefix(name)
    try:
        entries = os.listdir(folder)
    except OSError:
        return []
    stale = []
    for entry in entries:
        if not entry.startswith(prefix):
            continue
        m = re.fullmatch(r"(\d+)-[0-9a-f]+", entry[len(prefix):])
        if m and int(m[1]) != os.getpid() and not _alive(int(m[1])):
            stale.append((os.path.join(folder, entry), int(m[1])))
    return sorted(stale)


def remove_stale(path, say=None):
    """Remove path's temporaries left by dead processes of this host; say so in one line.

    Returns the paths removed. say(line) defaults to printing on stderr.
    """
    removed, pids = [], []
    for tmp, pid in stale_temporaries(path):
        with contextlib.suppress(FileNotFoundError):  # another writer removed it first
            os.unlink(tmp)
            removed.append(tmp)
            pids.append(pid)
    if removed:
        line = (f"spmd: removed {len(removed)} temporary file{'s' * (len(removed) > 1)} of "
                f"{os.fspath(path)} left by dead process{'es' * (len(pids) > 1)} "
                f"(pid {', '.join(map(str, sorted(set(pids))))}) on this host")
        if say is None:
            print(line, file=sys.stderr, flush=True)
        else:
            say(line)
    return removed


def fsync_dir(folder):
    with contextlib.suppress(OSError):  # some file systems cannot open or sync a directory
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _place(tmp, path, exclusive):
    """Move tmp onto path: replace it, or with exclusive only if path does not exist."""
    if not exclusive:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # fails with FileExistsError if path exists: never overwrites
    except FileExistsError:
        raise
    except OSError:  # no hard links here: a check, then a rename (a small race)
        if os.path.lexists(path):
            raise FileExistsError(f"{path} exists") from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


class AtomicFile:
    """A temporary beside path, open for writing; commit() puts it in place, discard() removes it.

    file is binary, or text in encoding with text=True. exclusive:
    commit fails with FileExistsError if path exists by then. Creating
    one first removes path's stale temporaries (:func:`remove_stale`).
    """

    def __init__(self, path, *, text=False, exclusive=False, encoding="utf-8", say=None):
        self.path = os.fspath(path)
        self.exclusive = exclusive
        self.folder = os.path.dirname(os.path.abspath(self.path))
        remove_stale(self.path, say)
        self.tmp = temporary_name(self.path)
        # "x": created here or an error, with 0o666 less the umask, as the target itself would be
        try:
            self.file = open(self.tmp, "x", encoding=encoding) if text else open(self.tmp, "xb")
        except BaseException:
            with contextlib.suppress(FileNotFoundError):  # a bad encoding fails after creating it
                os.unlink(self.tmp)
            raise
        self.state = "open"

    def commit(self):
        """Flush, fsync, rename onto the target and fsync the directory; return the target's path."""
        if self.state == "committed":
            return self.path
        if self.state == "discarded":
            raise FileNotFoundError(errno.ENOENT, f"{self.path} was discarded, not written", self.tmp)
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            _place(self.tmp, self.path, self.exclusive)
        except BaseException:
            self.discard()
            raise
        self.state = "committed"
        fsync_dir(self.folder)
        return self.path

    def discard(self):
        """Close and remove the temporary; the target stays as it was."""
        if self.state == "committed":
            return
        self.state = "discarded"
        with contextlib.suppress(OSError, ValueError):
            self.file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)

    def __enter__(self):
        return self.file

    def __exit__(self, kind, value, tb):
        if kind is None:
            self.commit()
        else:
            self.discard()
        return False


def atomic_write(path: str | os.PathLike[str], *, text: bool = False, exclusive: bool = False,
                 encoding: str = "utf-8") -> AtomicFile:
    """Return a context manager whose file object (binary, or text) becomes path when the block ends without error."""
    return AtomicFile(path, text=text, exclusive=exclusive, encoding=encoding)


@contextlib.contextmanager
def atomic_path(path, *, exclusive=False):
    """Yield a temporary path (created empty) to write; it becomes path when the block ends without error.

    For writers that open the file themselves (savefig, PIL, a memmap).
    The temporary's name does not end like path's: give such writers
    the format explicitly.
    """
    out = AtomicFile(path, exclusive=exclusive)
    out.file.close()
    try:
        yield out.tmp
        out.file = open(out.tmp, "rb")  # commit fsyncs what the writer wrote, then renames
        out.commit()
    except BaseException:
        out.discard()
        raise
