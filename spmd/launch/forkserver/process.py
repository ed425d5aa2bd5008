"""Process helpers of the fork servers: dying with a parent, ending at once, what was preloaded.

``preloaded()`` owns this process's record of the modules its fork server
imported before forking it (docs/preload.md).  Only the standard library.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable, NoReturn

__all__ = ["death_signal", "die_with", "flush_std", "end_now", "preloaded", "record_preloaded"]

# In a server and every rank forked from it: the modules it imported (preloaded() returns them).
_preloaded: tuple[str, ...] = ()


def preloaded() -> tuple[str, ...]:
    """Return the modules this process's fork server imported before forking it; () if not forked."""
    return _preloaded


def record_preloaded(modules: list[str] | tuple[str, ...]) -> None:
    """In a server, after its imports: record them as what preloaded() returns here and in its ranks."""
    global _preloaded
    _preloaded = tuple(modules)


def death_signal(parent: int) -> Callable[[], None] | None:
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


def die_with(parent: int) -> None:
    """In a child of parent (the server's pid, read before the fork): die with it."""
    arm = death_signal(parent)
    if arm is not None:
        arm()


def flush_std() -> None:
    """Flush Python's stdout and stderr, so a child does not write what the server buffered."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass


def end_now(code: int) -> NoReturn:
    """End the server now: its finalization (torch's modules) would cost the launcher half a second."""
    flush_std()
    os._exit(code)
