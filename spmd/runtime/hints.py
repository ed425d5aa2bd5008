"""One line rank 0 says at start when the job is set up slower than it could be (SPMD_HINTS=0: none).

More ranks on a host than CPUs is correct but slow: the ranks take turns,
each imports torch on its own, and the work is done no faster than on as
many ranks as CPUs.  A newcomer sees only a long wait; one line says why
and what would help.
"""

from __future__ import annotations

import os
import sys

__all__ = ["cpus", "oversubscribed", "at_start"]


def cpus() -> int:
    """CPUs this process may run on (its affinity: what a batch system allotted), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def oversubscribed(ranks: int, cpus: int) -> str | None:
    """The line for ranks on a host of cpus CPUs, or None when each rank has a CPU."""
    if ranks <= cpus:
        return None
    return (f"spmd: {ranks} ranks share this host's {cpus} CPU{'s' * (cpus != 1)} and take turns: start-up "
            f"(each rank imports torch) is slow and the work goes no faster than on {cpus}; "
            f"`spmd run --preload torch -n {ranks}` starts faster, and -n {cpus} works as fast")


def at_start(rank: int, ranks_here: int) -> None:
    """On rank 0, print the hints that apply to its host."""
    if rank != 0:
        return
    line = oversubscribed(ranks_here, cpus())
    if line:
        print(line, file=sys.stderr, flush=True)
