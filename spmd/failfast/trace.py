"""The merged trace of a job (``SPMD_TRACE=path``): every rank's calls, the table, and who the collectives waited for.

Each rank's :class:`~spmd.failfast.calls.Monitor` records its calls' start
and duration; at finalize rank 0 gathers them with each rank's host, prints
the table (:func:`summarize`, :func:`format_summary`) and the ranks the
collectives waited for (:func:`waits`, :func:`format_waits`), and writes a
Chrome trace (:func:`chrome_trace`, Perfetto-readable) with each process
named by rank and host and each collective by the rank that came last.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from typing import Any, NamedTuple, Sequence

from spmd.failfast.calls import P2P
from spmd.util.bandwidth import bus_factor
from spmd.util.words import ranks_text

__all__ = ["report", "summarize", "format_summary", "waits", "format_waits", "Wait", "last_ranks", "chrome_trace",
           "write_trace"]


def report(path, said, size):
    """On rank 0 at finalize: write the merged trace to path, and print the table and who the
    collectives waited for.  said: each rank's (host, events), in rank order."""
    hosts, per_rank = [h for h, _ in said], [events for _, events in said]
    write_trace(path, per_rank, hosts)
    table = format_summary(summarize([e for events in per_rank for e in events], size), size)
    waited = format_waits(waits(per_rank, hosts))
    sys.stderr.write(table + (f"\n{waited}" if waited else "") + f"\ntrace written to {path}\n")


def summarize(events, size):
    """Return rows (op, count, bytes, seconds, algbw, busbw) from all ranks' events."""
    by_op = collections.defaultdict(lambda: [0, 0, 0.0])
    for e in events:
        if e["dur"] is None:
            continue
        row = by_op[e["name"]]
        row[0] += 1
        row[1] += e["bytes"]
        row[2] += e["dur"]
    rows = []
    for name, (count, nbytes, seconds) in sorted(by_op.items()):
        algbw = nbytes / seconds if seconds > 0 else 0.0
        factor = bus_factor(name, size) if size > 1 else 1.0
        rows.append((name, count, nbytes, seconds, algbw, algbw * factor))
    return rows


def format_summary(rows, size):
    """Render summarize()'s rows as a text table (times summed over ranks)."""
    lines = [
        f"spmd trace: collectives over {size} ranks (times and bytes summed over ranks)",
        f"{'op':<18}{'count':>8}{'bytes':>14}{'time s':>10}{'algbw GB/s':>12}{'busbw GB/s':>12}",
    ]
    for name, count, nbytes, seconds, algbw, busbw in rows:
        lines.append(
            f"{name:<18}{count:>8}{nbytes:>14}{seconds:>10.4f}{algbw / 1e9:>12.3f}{busbw / 1e9:>12.3f}"
        )
    return "\n".join(lines)


def last_ranks(per_rank: Sequence[Sequence[dict[str, Any]]]) -> dict[int, tuple[int, float]]:
    """Return {seq: (the rank that came last, rank-seconds the others waited for it)} of the world's
    blocking collectives that every rank traced.

    A blocking collective ends on every rank at about the same moment, so
    the rank that came last is the one whose call was shortest, and each
    other rank waited its own duration less that one: no clocks compared
    across hosts.  Point to point, async calls (timed to when their
    completion was seen) and a split's calls (other ranks, other numbers)
    are left out.
    """
    size = len(per_rank)
    calls: dict[int, dict[int, float]] = collections.defaultdict(dict)
    for rank, events in enumerate(per_rank):
        for e in events:
            if e["dur"] is None or e["name"] in P2P or e.get("sub") or e.get("async"):
                continue
            calls[e["seq"]][rank] = e["dur"]
    out = {}
    for seq, durs in calls.items():
        if len(durs) == size and size > 1:
            last = min(durs, key=durs.__getitem__)
            out[seq] = (last, sum(d - durs[last] for d in durs.values()))
    return out


class Wait(NamedTuple):
    """The collectives' waits on one host (or, on one host, one rank): who, how often last, how long."""

    where: str  # 'h2 (ranks 2, 3)', or 'rank 2' when the job has one host
    last: int  # calls in which one of its ranks came last
    waited: float  # rank-seconds the other ranks spent waiting for those
    calls: int  # the collectives counted


def waits(per_rank: Sequence[Sequence[dict[str, Any]]], hosts: Sequence[str | None]) -> list[Wait]:
    """Return who the world's collectives waited for, most waited-for first: per host when the job
    spans several (hosts[r] is rank r's host), else per rank; only those that ever came last."""
    lasts = last_ranks(per_rank)
    names = [h or "?" for h in hosts]
    several = len(set(names)) > 1
    members: dict[str, list[int]] = collections.defaultdict(list)
    for rank, name in enumerate(names):
        members[name if several else f"rank {rank}"].append(rank)
    key = {r: (names[r] if several else f"rank {r}") for r in range(len(names))}
    count: dict[str, int] = collections.Counter()
    waited: dict[str, float] = collections.defaultdict(float)
    for last, seconds in lasts.values():
        count[key[last]] += 1
        waited[key[last]] += seconds
    out = []
    for where in sorted(count, key=lambda w: (-waited[w], w)):
        label = f"{where} ({ranks_text(members[where])})" if several else where
        out.append(Wait(label, count[where], waited[where], len(lasts)))
    return out


def format_waits(rows: Sequence[Wait], most: int = 3) -> str:
    """Say who the collectives waited for: a line each for the most waited-for (none: '')."""
    if not rows:
        return ""
    lines = [f"spmd trace: the collectives waited most for {rows[0].where}: last to arrive in "
             f"{rows[0].last} of {rows[0].calls} calls, {rows[0].waited:.3f} rank-seconds of the others' waiting"]
    for row in rows[1:most]:
        lines.append(f"  then {row.where}: last in {row.last}, {row.waited:.3f} rank-seconds")
    return "\n".join(lines)


def chrome_trace(per_rank, hosts=None):
    """Return a Chrome trace (Perfetto-readable) from each rank's events (hosts: each rank's host)."""
    lasts = last_ranks(per_rank)
    out = []
    for rank, events in enumerate(per_rank):
        host = hosts[rank] if hosts else None
        name = f"rank {rank}" + (f" ({host})" if host else "")
        out.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": name}})
        for e in events:
            args = {"seq": e["seq"], "bytes": e["bytes"], **{k: e[k] for k in ("peer", "tag") if k in e}}
            if not e.get("sub") and e["seq"] in lasts and e["name"] not in P2P:
                args["last_rank"] = lasts[e["seq"]][0]
            out.append({
                "name": e["name"],
                "ph": "X",
                "pid": rank,
                "tid": 0,
                "ts": e["ts"] * 1e6,
                "dur": (e["dur"] or 0.0) * 1e6,
                "args": args,
            })
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_trace(path, per_rank, hosts=None):
    """Write the merged Chrome trace to path, atomically when it is a regular file."""
    if os.path.exists(path) and not os.path.isfile(path):  # a device or a pipe: write into it
        with open(path, "w") as f:
            json.dump(chrome_trace(per_rank, hosts), f)
        return
    from spmd.util.atomic import atomic_write

    with atomic_write(path, text=True) as f:
        json.dump(chrome_trace(per_rank, hosts), f)
