"""What a pipeline run reports: the phases it times, the progress bar on stderr, and the Result on root."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["PHASES", "Laps", "Bar", "PerRank", "Result"]

#: Phases timed on root, in the order they happen within a round.
PHASES = ("load", "scatter", "process", "gather", "check", "write", "verify")


class Laps:
    """A phase clock: each lap(phase) adds the seconds since the previous lap to that phase."""

    def __init__(self):
        self.started = self.last = time.perf_counter()
        self.times = dict.fromkeys(PHASES, 0.0)

    def __call__(self, phase):
        now = time.perf_counter()
        self.times[phase] += now - self.last
        self.last = now

    def timings(self):
        """Return the seconds per phase, leaving out verify if it never ran."""
        return {p: v for p, v in self.times.items() if v or p != "verify"}

    def total(self):
        """Return the seconds since the clock started."""
        return time.perf_counter() - self.started


class Bar:
    """A one-line progress bar on stderr, redrawn at most every 0.2 s."""

    def __init__(self, stream=None):
        self.stream, self.t0, self.last = stream or sys.stderr, time.perf_counter(), 0.0

    def __call__(self, done, total):
        now = time.perf_counter()
        if done < total and now - self.last < 0.2:
            return
        self.last = now
        frac = done / total if total else 1.0
        bar = "#" * int(30 * frac)
        self.stream.write(f"\r[{bar:<30}] {frac:4.0%} {done}/{total} rows {now - self.t0:.1f} s")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


class PerRank:
    """Each rank's rows, fn seconds and busy seconds, added up over the rounds (from their Statuses)."""

    def __init__(self, size):
        self.rows, self.seconds, self.busy = [0] * size, [0.0] * size, [0.0] * size

    def add(self, statuses):
        """Add one round's Statuses, one per rank in rank order."""
        for r, s in enumerate(statuses):
            self.rows[r] += s.rows
            self.seconds[r] += s.seconds
            self.busy[r] += s.busy


@dataclass
class Result:
    """What a pipeline run did, on root."""

    rows: int
    rows_out: int
    ranks: int
    backend: str
    rounds: int
    chunk_rows: int
    row_shape: tuple[int, ...]
    dtype: str
    #: Seconds on root per phase (see PHASES); process is wall time until the slowest rank is done.
    timings: dict[str, float]
    total_s: float
    #: CRC-32 of the output data in row order (C order, no .npy header).
    checksum: int
    input_checksum: int
    rows_per_rank: list[int]
    process_per_rank: list[float]
    #: The output array (output=None), the .npy path written, or None for a callable.
    output: Any = None
    #: True or False after verify=True, else None.
    verified: Optional[bool] = None
    mismatched_rows: int = 0
    first_mismatch: Optional[int] = None
    #: Seconds each rank took for its parts of the rounds (spmd.pipeline.balance): the speed balance's measure.
    busy_per_rank: Optional[list[float]] = None
    #: "crc32c" or "crc32" (spmd.pipeline.checksum): the kind of checksum and input_checksum.
    checksum_kind: str = "crc32"
    #: "parallel" (every rank read its own rows) or "root" (root read and scattered).
    read_mode: str = "root"
    #: "parallel" (every rank wrote its rows into the .npy), "root", "memory" or "callable".
    write_mode: str = "root"
    balance: str = "even"
    overlap: bool = True
    #: Rows and rounds a journal said were done before this run (resume=True), not read again.
    resumed_rows: int = 0
    resumed_rounds: int = 0
    #: Why a mode other than the fastest was used, one line each.
    notes: tuple[str, ...] = ()

    @property
    def rows_processed(self) -> int:
        """Rows read and computed by this run (a resumed run skips the journal's)."""
        return sum(self.rows_per_rank)

    @property
    def rows_per_second(self) -> float:
        return self.rows_processed / self.total_s if self.total_s > 0 else float("inf")

    def summary(self) -> str:
        """Return a few lines for people: sizes, phases, throughput, checksum."""
        each = f"{'x'.join(map(str, self.row_shape))} {self.dtype}" if self.row_shape else self.dtype
        phases = ", ".join(f"{p} {self.timings[p]:.3f}" for p in PHASES if p in self.timings)
        lines = [
            f"{self.rows} rows in, {self.rows_out} out ({each} each); "
            f"{_plural(self.ranks, 'rank')}, backend {self.backend}; "
            f"{_plural(self.rounds, 'round')} of up to {self.chunk_rows} rows",
            f"seconds: {phases}; total {self.total_s:.3f}",
            f"{self.rows_per_second:,.0f} rows/s; processing per rank: slowest "
            f"{max(self.process_per_rank):.3f} s, fastest {min(self.process_per_rank):.3f} s",
            f"read {self.read_mode}, write {self.write_mode}, balance {self.balance}, "
            f"overlap {'on' if self.overlap else 'off'}; rows per rank {', '.join(map(str, self.rows_per_rank))}",
            f"checksum {self.checksum_kind} {self.checksum:08x} (input {self.input_checksum:08x})",
        ]
        if self.resumed_rows:
            lines.append(f"resumed at row {self.resumed_rows} ({_plural(self.resumed_rounds, 'round')} done before); "
                         f"this run read and computed {self.rows_processed} rows")
        lines += [f"note: {n}" for n in self.notes]
        if self.verified is not None:
            lines.append(
                "verify: serial recomputation identical"
                if self.verified
                else f"verify: FAILED, {self.mismatched_rows} rows differ (first: row {self.first_mismatch})"
            )
        return "\n".join(lines)


def _plural(n, word):
    return f"{n} {word}{'s' * (n != 1)}"
