"""What spmd's reports say alike wherever they are made: a set of ranks, and how a process ended."""

from __future__ import annotations

import signal
from typing import Iterable

__all__ = ["span", "ranks_text", "signal_name", "exit_text"]


def span(ranks: Iterable[int]) -> str:
    """Ranks, sorted, as the shortest text: '0-3', '0,2', '0-2,5' (what ``--ranks`` and ``%on`` read back)."""
    ordered = sorted(ranks)
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if j == i else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def ranks_text(ranks: Iterable[int], ranges: bool = False) -> str:
    """Ranks, sorted, in words: 'rank 2', 'ranks 1, 3'; with ranges, as span() writes them: 'ranks 0-3'."""
    ordered = sorted(ranks)
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    return "ranks " + (span(ordered) if ranges else ", ".join(map(str, ordered)))


def signal_name(signum: int) -> str:
    """A signal's name ('SIGKILL'), or 'signal 99' for a number Python does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_text(code: int) -> str:
    """How a process ended, from its exit code as subprocess gives it (minus a signal's number when killed):
    'exited with code 3', 'killed by signal SIGKILL'."""
    if code < 0:
        name = signal_name(-code)
        return f"killed by {name}" if name.startswith("signal ") else f"killed by signal {name}"
    return f"exited with code {code}"
