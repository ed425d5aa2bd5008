"""Before the first round: what each rank has, and the modes every rank decides alike from that.

Every rank makes a :class:`Report` (its host, whether it has crc32c,
its memory, whether it could open the shared source) and all gather
them; the functions here turn the reports into the read mode, the
checksum and the memory budgets, the same on every rank since the
reports are. docs/pipeline.md says when each mode is used.
"""

from __future__ import annotations

import pickle
import socket
from typing import NamedTuple, Optional

import numpy as np

from spmd.errors import PipelineError, PipelineValueError
from spmd.pipeline import checksum
from spmd.pipeline.balance import free_memory, parse_budget
from spmd.pipeline.rounds import describe

__all__ = ["Report", "report", "read_mode", "checksum_of", "budgets", "raise_errors"]


class Report(NamedTuple):
    """What one rank tells the others before the first round."""

    host: str
    crc32c: bool
    error: Optional[str] = None  # its memory budget or free memory could not be told
    read: Optional[str] = None  # why it cannot open the shared source, or None
    free: Optional[int] = None  # bytes free where it runs (balance='memory' without budgets)
    budget: Optional[int] = None  # its budget in bytes (memory=)


def report(plan, options, rank, root):
    """Return (this rank's Report, the source it opened from the plan or None)."""
    host = socket.gethostname()
    error = read = free = budget = None
    try:
        if options.memory is not None:
            budget = parse_budget(options.memory, rank)
        elif options.balance == "memory":
            free = free_memory()
    except Exception as exc:
        error = describe(exc)
    src = None
    if plan.shared is not None and rank != root:
        try:
            src = pickle.loads(plan.shared)
            here = (tuple(src.shape), str(np.dtype(src.dtype)))
            if here != (plan.shape, plan.dtype):
                raise PipelineValueError(f"it holds {here[1]} rows of shape {here[0]} here, but "
                                         f"{plan.dtype} rows of shape {plan.shape} on root")
            if plan.identity is not None and str(src.identity()) != plan.identity:
                raise PipelineValueError(f"its files differ from root's: {src.identity()} here, "
                                         f"{plan.identity} on root")
        except Exception as exc:
            src = None
            read = f"{host}: {describe(exc)}"
    return Report(host, checksum.has_crc32c(), error, read, free, budget), src


def raise_errors(reports):
    """Raise the first rank's error, alike on every rank."""
    for r, x in enumerate(reports):
        if x.error:
            raise PipelineError(f"pipeline: on rank {r}: {x.error}")


def read_mode(plan, read, reports):
    """Return (the read mode, a note or None): parallel where every rank opened the source."""
    cannot = [(r, x.read) for r, x in enumerate(reports) if x.read]
    if plan.shared is not None and not cannot:
        return "parallel", None
    if plan.shared is None:
        why = plan.why_root
    else:
        why = f"rank {cannot[0][0]} cannot open the source ({cannot[0][1]})"
    if read == "parallel":
        raise PipelineError(f"pipeline: read='parallel' is impossible: {why}; sources every rank can read "
                            "say every_rank = True (.npy files and shard folders on a file system all "
                            "ranks see, synthetic tables); or pass read='auto'")
    if read == "auto" and len(reports) > 1:
        return "root", f"root reads and scatters: {why}"
    return "root", None


def checksum_of(plan, reports):
    """Return the checksum every rank uses: the plan's kind, else crc32 where a rank lacks crc32c."""
    kind = plan.checksum
    lacking = [r for r, x in enumerate(reports) if not x.crc32c]
    if kind == "crc32c" and lacking:
        if plan.forced:
            raise PipelineError(f"pipeline: checksums are crc32c (SPMD_CHECKSUM or the journal) but ranks "
                                f"{', '.join(map(str, lacking))} lack the crc32c package: pip install "
                                "crc32c where they run")
        kind = "crc32"
    return checksum.get(kind)


def budgets(reports):
    """Return every rank's memory budget (a free memory shared among its host's ranks), or None."""
    hosts = [x.host for x in reports]
    each = [x.budget if x.budget is not None
            else None if x.free is None else x.free // hosts.count(x.host) for x in reports]
    return each if any(b is not None for b in each) else None
