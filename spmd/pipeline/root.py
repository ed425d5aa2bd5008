"""Root's side of a pipeline run: the input, the output and its journal, the checksums, verify.

:class:`Root` opens what only root opens (the source as given, the
output, a resume journal: :mod:`spmd.pipeline.journal`) and decides the
:class:`spmd.pipeline.plan.Plan`; it makes the .npy output once the
first round tells its layout, joins every rank's checksums, writes
gathered rounds (in :class:`spmd.pipeline.rounds.Writer`'s thread) and
puts the output in place at the end. A failure found here is kept
(:meth:`Root.fail`) and travels in root's next Status, so every rank
raises the same error (:mod:`spmd.pipeline.ranks`).
"""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np

from spmd.pipeline import checksum
from spmd.errors import PipelineError, PipelineJournalError, PipelineValueError
from spmd.pipeline.journal import Journal, differences
from spmd.pipeline.progress import Bar
from spmd.pipeline.plan import Plan
from spmd.pipeline.rounds import Writer, as_numpy, describe
from spmd.pipeline.outputs import open_sink
from spmd.pipeline.sinks import partial_path
from spmd.pipeline.sources import fingerprint, open_source

__all__ = ["Root", "task_name", "differing_rows"]


def task_name(fn, task):
    """What a resume journal records as the task: task, else fn's ``spmd_task``, else its name."""
    if task is not None:
        return str(task)
    own = getattr(fn, "spmd_task", None)
    if own is not None:
        return str(own)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def grid_of(sink, src, in_row_bytes):
    """Where shares and rounds may end: a Zarr output's chunks (each written by one rank; by default the
    input's chunks, where they are evenly spaced), else a chunked input's (each decoded by one), else any
    row (None)."""
    own = getattr(src, "grid", None)
    given = own() if callable(own) else None
    made = getattr(sink, "grid", None)
    if callable(made):
        return made(in_row_bytes, given)
    return None if given is None or given.free else given


class Root:
    """Root's books: the input, the output and its journal, the checksums, verify, the bar.

    A failure found here is kept in ``pending`` (:meth:`fail`) and
    travels in root's next Status, so every rank raises the same error.
    The rank side (:class:`spmd.pipeline.ranks.Ranks`) asks, through the
    methods, and never writes these fields.
    """

    def __init__(self, comm, fn, options, lap):
        self.comm, self.fn, self.lap = comm, fn, lap
        self.verify, self.overlap = options.verify, options.overlap
        self.plan = None
        self.pending = None
        self.in_crc = self.out_crc = 0
        self.rows_out = 0
        self.mismatched, self.first_bad = 0, None
        self.journal = None
        self.writer = None
        self.sent = None
        self.kept = None

    def open(self, source, output, chunk_rows, progress, read, resume, task):
        """Open the input, the output and any journal; return the plan every rank gets."""
        try:
            if callable(source) and not hasattr(source, "read"):
                source = source()
            self.src = src = open_source(source)
            rows = int(src.shape[0])
            chunk = int(chunk_rows) if chunk_rows else max(rows, 1)
            if chunk < 1:
                raise PipelineValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
            names = getattr(src, "columns", None)  # a Parquet input's: kept by a Parquet output
            names = names if isinstance(names, list) and all(isinstance(n, str) for n in names) else None
            self.sink = open_sink(output, rows, resume=resume, columns=names)
            if resume and not self.sink.positional:
                raise PipelineValueError("resume=True needs output to be a file path (.npy, .parquet, .h5, "
                                         ".zarr): the journal records rounds written there")
            self.bar = Bar() if progress is True else progress or None
            in_row_bytes = np.dtype(src.dtype).itemsize * int(np.prod(src.shape[1:], dtype=np.int64))
            plan = Plan(
                rows=rows, chunk=chunk, positional=self.sink.positional, resume=bool(resume),
                shape=tuple(src.shape), dtype=str(np.dtype(src.dtype)), in_row_bytes=in_row_bytes,
                checksum=checksum.kind(), forced=checksum.forced(),
                why_root="read='root'" if read == "root" else "the source is read by root alone",
                grid=grid_of(self.sink, src, in_row_bytes),
            )
            if read != "root" and getattr(src, "every_rank", False):
                try:
                    own = getattr(src, "identity", None)
                    plan = replace(plan, shared=pickle.dumps(src), identity=str(own()) if callable(own) else None)
                except Exception as exc:  # a local class, an open handle: root reads it
                    plan = replace(plan, why_root=f"the source does not pickle ({describe(exc)})")
            if self.sink.positional:
                plan = self._journal(output, resume, plan, src, task_name(self.fn, task))
            self.plan = plan
            return ("ok", plan)
        except PipelineError as exc:  # spmd's own word on the arguments or the journal: as it is
            return ("error", str(exc), type(exc).__name__)
        except Exception as exc:
            return ("error", f"cannot open the input: {describe(exc)}", "PipelineError")
        finally:
            self.lap("load")

    def _journal(self, output, resume, plan, src, task):
        """Start or load the journal of a positional output; return the plan, resumed where it says."""
        journal = Journal(output)
        found = journal.exists()
        if not found and not resume:
            return plan  # nothing to record or compare: no fingerprint (17 sampled rows, a chunk decoded each)
        self.identity = {"rows": plan.rows, "input": f"{src!r} fingerprint {fingerprint(src)}",
                         "task": task, "output": str(output)}
        if not found:
            self.journal = journal
            return plan
        journal.load()
        part = partial_path(output)
        if not resume:
            raise PipelineJournalError(
                f"{journal.path} holds {len(journal.rounds)} finished rounds ({journal.done} of "
                f"{journal.header.get('rows')} rows) of an interrupted run: run again with resume=True "
                f"(--resume) to continue at row {journal.done}, or delete {journal.path} and {part} to start over")
        now = dict(self.identity)
        if plan.forced:  # SPMD_CHECKSUM names a kind: it must be the journal's; else spmd takes the journal's
            now["checksum"] = plan.checksum
        wrong = differences(journal.header, now)
        if wrong:
            raise PipelineJournalError(
                f"{journal.path} does not match this run: " + "; ".join(wrong)
                + f". Run the command that made it, or delete {journal.path} and {part} to start over")
        kind = journal.header["checksum"]
        if kind == "crc32c" and not checksum.has_crc32c():
            raise PipelineJournalError(f"{journal.path} was written with crc32c checksums: pip install crc32c "
                                       "to resume it")
        layout = (journal.header["output_dtype"], tuple(journal.header["output_row_shape"]))
        self.sink.reopen(*layout)
        crc = checksum.get(kind)
        self._check_written(journal, crc)
        plan = replace(plan, start=journal.done, rounds_before=len(journal.rounds), layout=layout,
                       checksum=kind, forced=True)
        for r in journal.rounds:
            n = r["rows"][1] - r["rows"][0]
            self.in_crc = crc.combine(self.in_crc, r["in"], n * plan.in_row_bytes)
            self.out_crc = crc.combine(self.out_crc, r["out"], n * self.sink.row_bytes)
        self.rows_out = journal.done
        journal.reopen()
        self.journal = journal
        return plan

    def _check_written(self, journal, crc):
        """Check the rows the journal says are done against its checksums, round by round."""
        for r in journal.rounds:
            a, b = r["rows"]
            got = crc.of(self.sink.read_rows(a, b))
            if got != r["out"]:
                raise PipelineJournalError(
                    f"{self.sink.partial} rows {a} to {b} have {crc.name} {got:08x} but {journal.path} "
                    f"recorded {r['out']:08x}: the output was changed since; delete both to start over")

    def start_output(self, dtype, row_shape, start, kind):
        """Create the output (or take the reopened one); start the journal; return the ticket ranks open it with."""
        if self.sink.writer is None:
            self.sink.create(dtype, row_shape)
            if self.journal is not None:
                self.journal.start(dict(self.identity, checksum=kind, output_dtype=str(np.dtype(dtype)),
                                        output_row_shape=list(row_shape)))
        elif (str(np.dtype(dtype)), tuple(row_shape)) != (str(self.sink.dtype), self.sink.row_shape):
            raise PipelineJournalError(
                f"fn returns {np.dtype(dtype)} rows of shape {tuple(row_shape)} but the journal's output "
                f"holds {self.sink.dtype} rows of shape {self.sink.row_shape}: not the run that made it")
        if not getattr(self.sink, "parallel", True):  # root alone writes this format
            return None
        return self.sink.ticket(start)

    # -- a round: what Ranks asks of root --

    def fail(self, message):
        """Keep a failure for root's next Status, unless one is kept already."""
        if self.pending is None:
            self.pending = message

    def news(self):
        """The failure root's next Status carries: the first kept, else the writer thread's."""
        if self.pending is None and self.writer is not None and self.writer.error:
            self.pending = f"writing the output: {self.writer.error}"
        return self.pending

    def keep(self, block):
        """verify: keep the round's rows as read (fn may change its block in place)."""
        self.kept = block.copy() if self.verify else None

    def share_out(self, block, shares, crc):
        """Cut a round root read into the ranks' shares; keep their checksums and, for verify, the rows."""
        parts = np.split(block, np.cumsum(shares)[:-1])
        self.sent = [crc.of(p) for p in parts]
        self.keep(block)
        return parts

    def finish_round(self, span, statuses, got, crc, scattered):
        """Check what came back, join the checksums, hand the round to the output; the bar.

        got: the gathered blocks (None where every rank wrote its own);
        scattered: root read and scattered the round (check what ranks
        received against what was sent). A failure is kept (:meth:`fail`).
        """
        if self.writer is None:  # a user's callable output runs in the main thread
            self.writer = Writer(self.write, self.overlap and getattr(self.sink, "threaded", False))
        if self.pending is not None:
            return
        a, b = span.start, span.stop
        try:
            round_in, round_out = self._tally(a, b, statuses, got, crc, scattered)
            self.lap("check")
            if got is not None:
                result = got[0] if len(got) == 1 else np.concatenate(got)
                if self.verify:
                    self.check_serial(a, result)
                    self.lap("verify")
                self.writer.put((a, b, result, round_in, round_out))
                self.lap("write")
            elif self.journal is not None:  # every rank wrote and synced its rows
                self.journal.add(a, b, round_in, round_out)
                self.lap("write")
            if self.bar:
                self.bar(b, self.plan.rows)
        except Exception as exc:
            self.pending = f"after rows {a} to {b}: {describe(exc)}"

    def _tally(self, a, b, statuses, got, crc, scattered):
        """Check every rank's checksums; join them into the round's and the run's; return the round's."""
        in_row = self.plan.in_row_bytes
        s0 = statuses[0]
        out_row = np.dtype(s0.dtype).itemsize * int(np.prod(s0.row_shape, dtype=np.int64))
        round_in = round_out = 0
        for r, s in enumerate(statuses):
            if scattered and s.in_crc != self.sent[r]:
                raise PipelineError(f"rank {r} received {s.rows} rows with {crc.name} {s.in_crc:08x}, "
                                    f"not the rows with {crc.name} {self.sent[r]:08x} sent")
            if got is not None:
                g = got[r]
                if g.shape[0] != s.rows or crc.of(g) != s.out_crc:
                    raise PipelineError(f"rank {r} sent back {s.rows} rows with {crc.name} {s.out_crc:08x}, "
                                        f"but {g.shape[0]} rows with {crc.name} {crc.of(g):08x} arrived")
            round_in = crc.combine(round_in, s.in_crc, s.rows * in_row)
            round_out = crc.combine(round_out, s.out_crc, s.rows * out_row)
        self.in_crc = crc.combine(self.in_crc, round_in, (b - a) * in_row)
        self.out_crc = crc.combine(self.out_crc, round_out, (b - a) * out_row)
        self.rows_out += b - a
        return round_in, round_out

    def check_serial(self, a, result):
        """verify: recompute the round serially from the rows as read and count the rows that differ."""
        expect = np.ascontiguousarray(as_numpy(self.fn(self.kept)))
        bad = differing_rows(result, expect)
        if bad.size:
            self.mismatched += int(bad.size)
            if self.first_bad is None:
                self.first_bad = a + int(bad[0])

    def write(self, item):
        """Writer thread: put one gathered round in the output, sync it and journal it."""
        a, b, block, round_in, round_out = item
        self.sink(a, block)
        if self.journal is not None:
            self.sink.sync()
            self.journal.add(a, b, round_in, round_out)

    # -- the end --

    def drain(self):
        """Wait until the writer thread has written every round handed to it."""
        if self.writer is not None:
            self.writer.finish()

    def finish_output(self, empty):
        """After the last round: check every row came back, finish the output; return what Result shows."""
        if self.pending is None and self.rows_out != self.plan.rows:
            self.pending = f"{self.plan.rows} rows were read but {self.rows_out} came back"
        return self._close_output(self.pending is None, empty)

    def _close_output(self, ok, empty):
        try:
            written = self.sink.close(ok, empty)
            if ok and self.journal is not None:
                self.journal.remove()
            elif self.journal is not None:
                self.journal.close()
            return written
        except Exception as exc:
            self.pending = f"finishing the output: {describe(exc)}"
        finally:
            self.lap("write")

    def abandon(self):
        """After a failure: stop the writer, leave no half-written output, close the journal."""
        if self.writer is not None:
            self.writer.close()
        self.sink.close(False, None)
        if self.journal is not None:
            self.journal.close()

    def close(self):
        """After a run: stop the writer thread."""
        if self.writer is not None:
            self.writer.close()


def differing_rows(got, expect):
    """Return the indices of rows whose bytes differ (every row, if the shapes differ)."""
    if got.shape != expect.shape or got.dtype != expect.dtype:
        return np.arange(max(got.shape[0], expect.shape[0] if expect.ndim else 1))
    n = got.shape[0]
    if n == 0:
        return np.arange(0)
    g = got.reshape(n, -1).view(np.uint8) if got.ndim > 1 else got.reshape(n, 1).view(np.uint8)
    e = expect.reshape(n, -1).view(np.uint8) if expect.ndim > 1 else expect.reshape(n, 1).view(np.uint8)
    return np.flatnonzero((g != e).any(axis=1))
