"""How many of a round's rows each rank gets: evenly, capped by memory, or by measured speed.

:class:`Planner` decides each round's shares from what every rank
reported about the rounds before (the same numbers on every rank, so
every rank computes the same shares without a message): ``even``
(:func:`split`), ``memory`` (no rank above what its budget or free
memory holds over :data:`IN_FLIGHT` rounds) or ``speed`` (shares follow
each rank's measured rows per second, decayed by :data:`DECAY` per
round back, the first rounds small probes of a :data:`PROBE`-th of
``chunk_rows``, every rank at least :data:`FLOOR` of the fastest rate).
docs/pipeline.md ("Balance") says what each measures and why. The
output does not depend on the shares: fn computes every row on its own.
"""

import os

from spmd.errors import PipelineValueError

__all__ = ["MODES", "Planner", "split", "free_memory", "parse_budget", "IN_FLIGHT"]

MODES = ("even", "memory", "speed")

#: Rounds of a rank's rows in memory at once (the one being processed and the next, read ahead).
IN_FLIGHT = 2
#: speed: what the rows and seconds of the rounds before count for, per round since.
DECAY = 0.5
#: The least share of the fastest rank's rate a rank is given.
FLOOR = 0.05
#: speed: the first IN_FLIGHT rounds, planned before any is measured, have chunk_rows // PROBE rows.
PROBE = 4


def split(n, weights, caps=None):
    """Split n rows over ranks in proportion to weights, none above its cap; return the counts.

    A rank whose share would pass its cap gets its cap, and the rest is
    split among the others in proportion (water-filling); whole rows go
    by largest remainder, ties to the lower rank. Returns fewer than n
    rows in all only when the caps add up to less than n.
    """
    size = len(weights)
    caps = [n] * size if caps is None else [max(0, int(c)) for c in caps]
    counts = [0] * size
    left = min(n, sum(caps))
    open_ranks = [r for r in range(size) if caps[r] > 0]
    while open_ranks:
        total = sum(max(weights[r], 0.0) for r in open_ranks)
        if total > 0:
            shares = {r: left * max(weights[r], 0.0) / total for r in open_ranks}
        else:
            shares = {r: left / len(open_ranks) for r in open_ranks}
        over = [r for r in open_ranks if shares[r] > caps[r]]
        if not over:
            break
        for r in over:
            counts[r] = caps[r]
            left -= caps[r]
        open_ranks = [r for r in open_ranks if r not in over]
    if not open_ranks:
        return counts
    whole = {r: int(shares[r]) for r in open_ranks}
    rest = left - sum(whole.values())
    for r in sorted(open_ranks, key=lambda r: (-(shares[r] - whole[r]), r))[:rest]:
        whole[r] += 1
    for r in open_ranks:
        counts[r] = whole[r]
    return counts


def _read_int(path):
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def free_memory():
    """Return the bytes this process could still allocate: MemAvailable, or less under a cgroup limit."""
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    limit = _read_int("/sys/fs/cgroup/memory.max")  # cgroup v2 ("max" when unlimited)
    if limit is not None:
        used = _read_int("/sys/fs/cgroup/memory.current") or 0
        free = limit - used if free is None else min(free, limit - used)
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            free = 1 << 62
    return max(int(free), 0)


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_budget(spec, rank=0):
    """Return rank's memory budget in bytes from spec: None, a number of bytes, '512M', or a
    comma-separated list with one entry per rank ('2G,512M'; the last repeats)."""
    if spec is None:
        return None
    if isinstance(spec, (list, tuple)):
        items = list(spec)
    elif isinstance(spec, str):
        items = [s.strip() for s in spec.split(",") if s.strip()]
    else:
        items = [spec]
    if not items:
        raise PipelineValueError(f"memory budget {spec!r}: give bytes, e.g. 512M or 2G,512M (one per rank)")
    item = items[min(rank, len(items) - 1)]
    if isinstance(item, (int, float)) and not isinstance(item, bool):
        value = int(item)
    else:
        text = str(item).strip().lower().removesuffix("ib").removesuffix("b")
        unit = text[-1] if text and text[-1] in _UNITS else ""
        try:
            value = int(float(text[: len(text) - len(unit)]) * _UNITS[unit])
        except ValueError:
            raise PipelineValueError(f"memory budget {item!r}: expected bytes such as 512M, 2G or 1048576") from None
    if value <= 0:
        raise PipelineValueError(f"memory budget {item!r}: must be more than 0 bytes")
    return value


class Planner:
    """Each round's rows and shares, from the ranks' reports of the rounds before.

    budgets: each rank's bytes for the pipeline's rows (None: no caps).
    in_row_bytes: bytes per input row. grid (spmd.pipeline.grid, or None):
    where shares and rounds may end; moving an edge onto it changes a share
    by less than a chunk, past a memory cap too. Call :meth:`plan` for a
    round's shares and :meth:`observe` with every rank's (rows, seconds)
    once a round is done, in the same order on every rank.
    """

    def __init__(self, mode, size, chunk, in_row_bytes, budgets=None, grid=None):
        if mode not in MODES:
            raise PipelineValueError(f"balance={mode!r}: expected one of {', '.join(MODES)}")
        self.mode, self.size, self.chunk = mode, size, chunk
        self.in_row, self.out_row = max(int(in_row_bytes), 1), max(int(in_row_bytes), 1)
        self.budgets = budgets if mode == "memory" or (budgets and any(b is not None for b in budgets)) else None
        self.rates = [None] * size
        self.sums = [(0.0, 0.0)] * size
        self.planned = 0
        self.grid = grid  # where edges may fall (spmd.pipeline.grid), or None: any row

    def caps(self):
        """Return the rows each rank's memory holds per round, or None without budgets."""
        if self.budgets is None:
            return None
        per_row = (self.in_row + self.out_row) * IN_FLIGHT
        return [None if b is None else int(b // per_row) for b in self.budgets]

    def weights(self):
        if self.mode != "speed" or all(r is None for r in self.rates):
            return [1.0] * self.size
        known = [r for r in self.rates if r is not None]
        fastest, typical = max(known), sorted(known)[len(known) // 2]
        return [max(typical if r is None else r, FLOOR * fastest) for r in self.rates]

    def plan(self, rows_left, start=0):
        """Return the per-rank row counts of the round from row start (their sum is the round's rows)."""
        n = min(self.chunk if self.grid is None else self.grid.round_rows(self.chunk, self.size), rows_left)
        self.planned += 1
        if self.mode == "speed" and self.planned <= IN_FLIGHT:
            n = min(n, max(self.chunk // PROBE, self.size))
        caps = self.caps()
        if caps is not None:
            caps = [n if c is None else c for c in caps]
            if n > 0 and sum(caps) == 0:
                listing = ", ".join(f"rank {r}: {b} bytes" for r, b in enumerate(self.budgets))
                raise PipelineValueError(
                    f"balance='memory': no rank has memory for one row ({(self.in_row + self.out_row) * IN_FLIGHT} "
                    f"bytes: {IN_FLIGHT} rounds of a {self.in_row}-byte input row and a {self.out_row}-byte "
                    f"output row) within its budget ({listing}); give a larger budget")
        counts = split(n, self.weights(), caps)
        return counts if self.grid is None else self.grid.align(counts, start, start + rows_left)

    def observe(self, rows, seconds, out_row_bytes=None):
        """Take one round's rows and busy seconds per rank (and the output row's bytes, once known)."""
        if out_row_bytes:
            self.out_row = max(int(out_row_bytes), 1)
        for r, (n, s) in enumerate(zip(rows, seconds)):
            if n > 0 and s > 0:  # decayed sums: a round weighs by its rows, older rounds less
                self.sums[r] = (DECAY * self.sums[r][0] + n, DECAY * self.sums[r][1] + s)
                self.rates[r] = self.sums[r][0] / self.sums[r][1]
