"""Scatter, process, gather: apply a per-record function to a table on every rank.

The input is cut into rounds of ``chunk_rows`` rows; each round's rows
are shared out over the ranks (``balance``), every rank applies ``fn``
to its block, and the results are put in row order into the output,
checked on the way (record counts and checksums of every block, both
ways) and optionally recomputed serially on root::

    from spmd import comm
    from spmd.pipeline import pipeline

    def fn(block):                        # one output row per input row
        return block * 2.0

    result = pipeline(fn, "table.npy", output="doubled.npy", chunk_rows=100_000)
    if comm.rank == 0:                    # the Result lives on root
        print(result.summary())

Run it with ``mpirun -n 8 python mine.py`` or ``spmd run -n 8 mine.py``,
or plain python for a world of one. The input (given on root; other
ranks may pass None) is an array, a path (.npy file, directory of .npy
shards, .csv), a source object with ``shape``, ``dtype`` and
``read(start, stop)`` such as :class:`SyntheticTable`, or a callable
returning one of these, called on root only.

How rows move (the Result and ``summary()`` say which was used):

read
    ``"parallel"``: every rank reads its own rows from its own copy of
    the source, for sources that say every rank can read them
    (``every_rank = True``: .npy files and shard folders on a shared
    file system, synthetic tables) and open on every rank. ``"root"``:
    root reads each round and scatters it (an array in root's memory, a
    .csv file, a callable's object). ``"auto"`` (default): parallel
    where it works, else root.
write
    For a .npy output, ``"parallel"``: every rank writes its rows at
    their offsets in the output file, when every rank can open the file
    root made; ``"root"``: results are gathered to root, which writes
    them. ``"auto"``: parallel where it works. Other outputs (None: an
    array returned on root; a callable(start_row, block)) are gathered.
overlap
    Reading the next round and root's writing of the last one run in
    threads beside fn (default True); at most two rounds are in memory.
balance
    ``"even"``, ``"memory"`` or ``"speed"`` (:mod:`spmd.balance`);
    ``memory=`` gives each rank's budget (bytes, "512M", or one per rank
    "2G,512M").
resume
    With a .npy output, keep a journal (``<output>.journal``) and the
    unfinished output (``<output>.partial``), so that after a crash the
    same call with resume=True continues at the first unfinished round,
    at any world size (:mod:`spmd.journal`). Without resume an existing
    journal is an error that says what to do.

Every mode writes the same bytes. For an output that is bitwise
identical at every world size, chunking and balance, ``fn`` must compute
each row independently of how rows are batched;
:func:`spmd.tasks.fixed_batches` makes that easy.

This module does not import torch; ``fn`` may return tensors.
"""

import pickle
import socket

import numpy as np

from . import checksum, preempt
from .balance import MODES as BALANCES, Planner, free_memory, parse_budget
from .errors import (PipelineError, PipelineJournalError, PipelinePreempted, PipelineTypeError,
                     PipelineValueError)
from .journal import Journal, differences, journal_path
from .progress import PHASES, Bar, Laps, Result
from .rounds import Reader, Status, Writer, apply, as_numpy, describe
from .sinks import Collect, NpyFile, RowWriter, open_sink, partial_path
from .sources import ArraySource, CsvSource, NpySource, ShardSource, SyntheticTable, fingerprint, open_source

__all__ = [
    "pipeline",
    "Result",
    "PipelineError",
    "on_root",
    "open_source",
    "ArraySource",
    "NpySource",
    "ShardSource",
    "CsvSource",
    "SyntheticTable",
    "PHASES",
    "READS",
    "WRITES",
    "BALANCES",
]

READS = ("auto", "parallel", "root")
_ERRORS = {e.__name__: e for e in (PipelineError, PipelineJournalError, PipelineValueError, PipelineTypeError)}
WRITES = ("auto", "parallel", "root")


def _comm(comm):
    if comm is not None:
        return comm
    from . import comm as world

    return world


def on_root(work, *, comm=None, root=0, share=False):
    """Run ``work()`` on root alone and raise the same error everywhere if it fails.

    Returns work()'s value on root and None elsewhere, or root's value on
    every rank with ``share=True`` (it must then pickle). Every rank
    must call on_root, so a failure on root never leaves the others
    waiting in the next collective.
    """
    comm = _comm(comm)
    value = error = None
    if comm.rank == root:
        try:
            value = work()
        except Exception as exc:
            error = describe(exc)
    reply = comm.broadcast_object(("error", error) if error else ("ok", value if share else None), root)
    if reply[0] == "error":
        raise PipelineError(f"on rank {root}: {reply[1]}")
    return value if comm.rank == root else reply[1]


def _choice(name, value, allowed):
    if value not in allowed:
        raise PipelineValueError(f"{name}={value!r}: expected one of {', '.join(map(repr, allowed))}")


def _task_name(fn, task):
    if task is not None:
        return str(task)
    own = getattr(fn, "spmd_task", None)
    if own is not None:
        return str(own)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


# -- root's side -----------------------------------------------------------------------


class _Root:
    """Root's books: the input, the output and its journal, the checksums, verify, the bar.

    A failure found here is kept in ``pending`` and travels in root's
    next Status, so every rank raises the same error.
    """

    def __init__(self, comm, fn, verify, lap):
        self.comm, self.fn, self.verify, self.lap = comm, fn, verify, lap
        self.pending = None
        self.in_crc = self.out_crc = 0
        self.rows_out = 0
        self.mismatched, self.first_bad = 0, None
        self.journal = None
        self.writer = None
        self.sent = None

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
            self.sink = open_sink(output, rows, resume=resume)
            if resume and not self.sink.positional:
                raise PipelineValueError("resume=True needs output to be a .npy path: the journal records "
                                         "rounds written there")
            self.bar = Bar() if progress is True else progress or None
            plan = {
                "rows": rows, "chunk": chunk, "start": 0, "rounds_before": 0, "layout": None,
                "positional": self.sink.positional, "resume": bool(resume),
                "shape": tuple(src.shape), "dtype": str(np.dtype(src.dtype)),
                "in_row_bytes": np.dtype(src.dtype).itemsize * int(np.prod(src.shape[1:], dtype=np.int64)),
                "shared": None, "checksum": checksum.kind(), "forced": checksum.forced(),
            }
            plan["why_root"] = "read='root'" if read == "root" else "the source is read by root alone"
            if read != "root" and getattr(src, "every_rank", False):
                try:
                    plan["shared"] = pickle.dumps(src)
                except Exception as exc:  # a local class, an open handle: root reads it
                    plan["why_root"] = f"the source does not pickle ({describe(exc)})"
            if self.sink.positional:
                self._journal(output, resume, plan, src, _task_name(self.fn, task))
            return ("ok", plan)
        except PipelineError as exc:  # spmd's own word on the arguments or the journal: as it is
            return ("error", str(exc), type(exc).__name__)
        except Exception as exc:
            return ("error", f"cannot open the input: {describe(exc)}", "PipelineError")
        finally:
            self.lap("load")

    def _journal(self, output, resume, plan, src, task):
        journal = Journal(output)
        self.identity = {"rows": plan["rows"], "input": f"{src!r} fingerprint {fingerprint(src)}",
                         "task": task, "output": str(output)}
        if not journal.exists():
            if resume:
                self.journal = journal
            return
        journal.load()
        part = partial_path(output)
        if not resume:
            raise PipelineJournalError(
                f"{journal.path} holds {len(journal.rounds)} finished rounds ({journal.done} of "
                f"{journal.header.get('rows')} rows) of an interrupted run: run again with resume=True "
                f"(--resume) to continue at row {journal.done}, or delete {journal.path} and {part} to start over")
        now = dict(self.identity)
        if plan["forced"]:  # SPMD_CHECKSUM names a kind: it must be the journal's; else spmd takes the journal's
            now["checksum"] = plan["checksum"]
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
        plan.update(start=journal.done, rounds_before=len(journal.rounds), layout=layout,
                    checksum=kind, forced=True)
        for r in journal.rounds:
            n = r["rows"][1] - r["rows"][0]
            self.in_crc = crc.combine(self.in_crc, r["in"], n * plan["in_row_bytes"])
            self.out_crc = crc.combine(self.out_crc, r["out"], n * self.sink.row_bytes)
        self.rows_out = journal.done
        journal.reopen()
        self.journal = journal

    def _check_written(self, journal, crc):
        """Check the rows the journal says are done against its checksums, round by round."""
        for r in journal.rounds:
            a, b = r["rows"]
            got = crc.of(self.sink.read_rows(a, b))
            if got != r["out"]:
                raise PipelineJournalError(
                    f"{self.sink.partial} rows {a} to {b} have {crc.name} {got:08x} but {journal.path} "
                    f"recorded {r['out']:08x}: the output was changed since; delete both to start over")

    def start_output(self, dtype, row_shape, start, kind, rows):
        """Create the output file (or take the reopened one); start the journal; return where ranks write."""
        if self.sink.writer is None:
            self.sink.create(dtype, row_shape)
            if self.journal is not None:
                self.journal.start(dict(self.identity, checksum=kind, output_dtype=str(np.dtype(dtype)),
                                        output_row_shape=list(row_shape)))
        elif (str(np.dtype(dtype)), tuple(row_shape)) != (str(self.sink.dtype), self.sink.row_shape):
            raise PipelineJournalError(
                f"fn returns {np.dtype(dtype)} rows of shape {tuple(row_shape)} but the journal's output "
                f"holds {self.sink.dtype} rows of shape {self.sink.row_shape}: not the run that made it")
        nonce = np.frombuffer(np.random.bytes(8), np.uint8)
        room = (rows - start) * self.sink.row_bytes
        if room >= nonce.size:  # where a rank that sees this file finds these bytes
            self.sink.writer.write_bytes(self.sink.header_bytes + start * self.sink.row_bytes, nonce)
        return self.sink.where, self.sink.header_bytes, self.sink.row_bytes, nonce.tobytes() if room >= 8 else b""

    def check_serial(self, a, result):
        """verify: recompute the round serially from the rows as read and count the rows that differ."""
        expect = np.ascontiguousarray(as_numpy(self.fn(self.kept)))
        bad = _differing_rows(result, expect)
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

    def close(self, ok, empty):
        """Finish the output; return what the Result shows as output."""
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


# -- every rank's side -----------------------------------------------------------------


class _Run:
    """One rank's side of a pipeline run: agree on the modes, then the rounds, then the end."""

    def __init__(self, comm, fn, root, boss, plan, lap, options):
        self.comm, self.fn, self.root, self.boss, self.plan, self.lap = comm, fn, root, boss, plan, lap
        self.read, self.write, self.balance, self.memory, self.verify, self.overlap = options
        self.rank, self.size = comm.rank, comm.size
        self.src = boss.src if boss else None
        self.reader = self.rows_writer = None
        self.read_mode, self.write_mode, self.notes = "root", None, []
        self.layout = None
        self.rank_rows, self.rank_secs, self.rank_busy = [0] * self.size, [0.0] * self.size, [0.0] * self.size
        self.rounds = 0
        self.empty = None

    # -- before the first round --

    def agree(self):
        """Tell every rank what this one has (a copy of the source, crc32c, memory); decide the modes."""
        comm, plan = self.comm, self.plan
        report = {"host": socket.gethostname(), "crc32c": checksum.has_crc32c(), "error": None,
                  "read": None, "free": None, "budget": None}
        try:
            if self.memory is not None:
                report["budget"] = parse_budget(self.memory, self.rank)
            elif self.balance == "memory":
                report["free"] = free_memory()
        except Exception as exc:
            report["error"] = describe(exc)
        if plan["shared"] is not None and self.rank != self.root:
            try:
                src = pickle.loads(plan["shared"])
                here = (tuple(src.shape), str(np.dtype(src.dtype)))
                if here != (plan["shape"], plan["dtype"]):
                    raise PipelineValueError(f"it holds {here[1]} rows of shape {here[0]} here, but "
                                             f"{plan['dtype']} rows of shape {plan['shape']} on root")
                self.src = src
            except Exception as exc:
                report["read"] = f"{report['host']}: {describe(exc)}"
        reports = comm.all_gather_object(report)
        for r, x in enumerate(reports):
            if x["error"]:
                raise PipelineError(f"pipeline: on rank {r}: {x['error']}")
        self._read_mode(reports)
        self._checksum(reports)
        hosts = [x["host"] for x in reports]
        budgets = [x["budget"] if x["budget"] is not None
                   else None if x["free"] is None else x["free"] // hosts.count(x["host"]) for x in reports]
        self.budgets = budgets if any(b is not None for b in budgets) else None
        self.planner = Planner(self.balance, self.size, plan["chunk"], plan["in_row_bytes"], self.budgets)
        reading = self.read_mode == "parallel" or self.rank == self.root
        self.reader = Reader(self.src.read, self.overlap) if reading else None

    def _read_mode(self, reports):
        cannot = [(r, x["read"]) for r, x in enumerate(reports) if x["read"]]
        if self.plan["shared"] is not None and not cannot:
            self.read_mode = "parallel"
            return
        if self.plan["shared"] is None:
            why = self.plan["why_root"]
        else:
            why = f"rank {cannot[0][0]} cannot open the source ({cannot[0][1]})"
        if self.read == "parallel":
            raise PipelineError(f"pipeline: read='parallel' is impossible: {why}; sources every rank can read "
                                "say every_rank = True (.npy files and shard folders on a file system all "
                                "ranks see, synthetic tables); or pass read='auto'")
        if self.read == "auto" and self.size > 1:
            self.notes.append(f"root reads and scatters: {why}")

    def _checksum(self, reports):
        kind = self.plan["checksum"]
        lacking = [r for r, x in enumerate(reports) if not x["crc32c"]]
        if kind == "crc32c" and lacking:
            if self.plan["forced"]:
                raise PipelineError(f"pipeline: checksums are crc32c (SPMD_CHECKSUM or the journal) but ranks "
                                    f"{', '.join(map(str, lacking))} lack the crc32c package: pip install "
                                    "crc32c where they run")
            kind = "crc32"
        self.crc = checksum.get(kind)

    # -- a round --

    def request(self, a, shares):
        """Ask for this rank's rows of the round starting at row a (read ahead with overlap)."""
        if self.reader is None:
            return
        b = a + sum(shares)
        if self.read_mode == "root" or self.verify and self.rank == self.root:
            self.reader.request(a, b)
        else:
            off = sum(shares[: self.rank])
            self.reader.request(a + off, a + off + shares[self.rank])

    def _no_rows(self):
        return np.empty((0,) + tuple(self.plan["shape"][1:]), np.dtype(self.plan["dtype"]))

    def obtain(self, a, shares):
        """Return (this rank's block, an error reading it, seconds reading) for the round at row a."""
        b, boss, lap = a + sum(shares), self.boss, self.lap
        whole = self.read_mode == "root" or self.verify and boss is not None
        if self.read_mode == "parallel":
            done = self.reader.take()
            if boss:
                lap("load")
            if done.error:
                return self._no_rows(), ("read", done.error), done.seconds
            block = done.value
            want = (b - a) if whole else shares[self.rank]
            if block.shape[0] != want or tuple(block.shape[1:]) != self.plan["shape"][1:]:
                return self._no_rows(), ("read", f"reading rows {a} to {b} gave shape {block.shape}"), done.seconds
            if not whole:
                return block, None, done.seconds
            off = sum(shares[: self.rank])
            boss.kept = block.copy() if self.verify else None
            return block[off : off + shares[self.rank]], None, done.seconds
        parts, seconds = None, 0.0
        if boss:
            done = self.reader.take()
            lap("load")
            seconds = done.seconds
            block = done.value
            if done.error:
                boss.pending = boss.pending or done.error
            elif block.shape[0] != b - a or tuple(block.shape[1:]) != self.plan["shape"][1:]:
                boss.pending = boss.pending or f"reading rows {a} to {b} gave shape {block.shape}"
            elif boss.pending is None:
                parts = np.split(block, np.cumsum(shares)[:-1])
                boss.sent = [self.crc.of(p) for p in parts]
                # fn may change its block in place; verify needs the rows as read
                boss.kept = block.copy() if self.verify else None
                lap("check")
        _raise_pending(self.comm.broadcast_object(boss and boss.pending, self.root), self.root)
        part = self.comm.scatter(parts, self.root)
        if boss:
            lap("scatter")
        return part, None, seconds

    def write_own(self, a, shares, out):
        """Write this rank's output rows at their offsets; return (error, seconds)."""
        t = _now()
        try:
            dtype, row_shape = self.layout
            if out.dtype != dtype or tuple(out.shape[1:]) != row_shape:
                raise PipelineValueError(f"fn returned {out.dtype} rows of shape {tuple(out.shape[1:])}; "
                                         f"the output holds {dtype} rows of shape {row_shape}")
            self.rows_writer.write(a + sum(shares[: self.rank]), out)
            if self.plan["resume"]:
                self.rows_writer.sync()
        except Exception as exc:
            return ("write", f"writing rows {a} to {a + sum(shares)}: {describe(exc)}"), _now() - t
        return None, _now() - t

    def start_writing(self, dtype, row_shape, start):
        """Make the .npy output (root) and decide who writes it: every rank at its offsets, or root."""
        comm, boss = self.comm, self.boss
        parallel = self.write != "root" and not self.verify
        msg = None
        if boss:
            try:
                made = boss.start_output(dtype, row_shape, start, self.crc.name, self.plan["rows"])
                msg = ("ok",) + made if parallel else ("root",)
            except Exception as exc:
                msg = ("error", describe(exc))
        msg = comm.broadcast_object(msg, self.root)
        if msg[0] == "error":
            raise PipelineError(f"pipeline: on rank {self.root}: making the output: {msg[1]}")
        self.layout = (np.dtype(dtype), tuple(row_shape))
        if msg[0] == "root":
            self.write_mode = "root"
            return
        _, where, header_bytes, row_bytes, nonce = msg
        error = None
        if boss:
            self.rows_writer = boss.sink.writer
        else:
            try:
                self.rows_writer = RowWriter(where, header_bytes, row_bytes)
                offset = header_bytes + start * row_bytes
                if nonce and self.rows_writer.read_bytes(offset, len(nonce)) != nonce:
                    raise PipelineError(f"{where} here is not the file rank {self.root} made "
                                        "(no file system shared with it)")
            except Exception as exc:
                error = f"{socket.gethostname()}: {describe(exc)}"
        errors = comm.all_gather_object(error)
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if not bad:
            self.write_mode = "parallel"
            return
        if self.write == "parallel":
            raise PipelineError(f"pipeline: write='parallel' is impossible: rank {bad[0][0]} cannot write "
                                f"the output ({bad[0][1]}); pass write='auto' to have root write it")
        self.notes.append(f"root writes: rank {bad[0][0]} cannot open the output ({bad[0][1]})")
        if not boss and self.rows_writer is not None:
            self.rows_writer.close(sync=False)
        self.rows_writer = None
        self.write_mode = "root"

    def status(self, out, error, in_crc, out_crc, seconds, busy, rows):
        boss = self.boss
        pending = boss.pending if boss else None
        if boss and pending is None and boss.writer is not None and boss.writer.error:
            pending = boss.pending = f"writing the output: {boss.writer.error}"
        shape, dtype = (tuple(out.shape[1:]), str(out.dtype)) if out is not None else ((), "")
        return Status(error, pending, rows, in_crc, shape, dtype, out_crc, seconds, busy, preempt.flagged())

    def finish_round(self, a, b, shares, statuses, got):
        """Root: check what came back, join the checksums, hand the round to the output; the bar."""
        boss, crc, lap = self.boss, self.crc, self.lap
        if boss.pending is not None:
            return
        try:
            in_row = self.plan["in_row_bytes"]
            s0 = statuses[0]
            out_row = np.dtype(s0.dtype).itemsize * int(np.prod(s0.row_shape, dtype=np.int64))
            round_in = round_out = 0
            for r, s in enumerate(statuses):
                if self.read_mode == "root" and s.in_crc != boss.sent[r]:
                    raise PipelineError(f"rank {r} received {s.rows} rows with {crc.name} {s.in_crc:08x}, "
                                        f"not the rows with {crc.name} {boss.sent[r]:08x} sent")
                if got is not None:
                    g = got[r]
                    if g.shape[0] != s.rows or crc.of(g) != s.out_crc:
                        raise PipelineError(f"rank {r} sent back {s.rows} rows with {crc.name} {s.out_crc:08x}, "
                                            f"but {g.shape[0]} rows with {crc.name} {crc.of(g):08x} arrived")
                round_in = crc.combine(round_in, s.in_crc, s.rows * in_row)
                round_out = crc.combine(round_out, s.out_crc, s.rows * out_row)
            boss.in_crc = crc.combine(boss.in_crc, round_in, (b - a) * in_row)
            boss.out_crc = crc.combine(boss.out_crc, round_out, (b - a) * out_row)
            boss.rows_out += b - a
            lap("check")
            if got is not None:
                result = got[0] if len(got) == 1 else np.concatenate(got)
                if self.verify:
                    boss.check_serial(a, result)
                    lap("verify")
                boss.writer.put((a, b, result, round_in, round_out))
                lap("write")
            elif boss.journal is not None:  # every rank wrote and synced its rows
                boss.journal.add(a, b, round_in, round_out)
                lap("write")
            if boss.bar:
                boss.bar(b, self.plan["rows"])
        except Exception as exc:
            boss.pending = f"after rows {a} to {b}: {describe(exc)}"

    def rounds_loop(self):
        plan, comm, boss, lap = self.plan, self.comm, self.boss, self.lap
        rows, pos = plan["rows"], plan["start"]
        if plan["positional"] and plan["layout"] is not None:  # a resumed output: its layout is known
            dtype, row_shape = np.dtype(plan["layout"][0]), tuple(plan["layout"][1])
            self.empty = np.empty((0,) + row_shape, dtype)
            self.start_writing(dtype, row_shape, pos)
        if pos >= rows and not (rows == 0 and pos == 0):
            return
        shares = self.planner.plan(rows - pos)
        self.request(pos, shares)
        while True:
            a = pos
            b = a + sum(shares)
            nxt = self.planner.plan(rows - b) if b < rows else None
            if nxt is not None:
                self.request(b, nxt)  # read ahead while fn works on this round
            part, error, read_secs = self.obtain(a, shares)
            if error is None:
                out, fail, in_crc, out_crc, secs = apply(self.fn, part, self.crc)
                error = fail and ("fn", fail)
            else:
                out, in_crc, out_crc, secs = None, 0, 0, 0.0
            write_secs = 0.0
            if error is None and self.write_mode == "parallel":
                error, write_secs = self.write_own(a, shares, out)
            st = self.status(out, error, in_crc, out_crc, secs, read_secs + secs + write_secs, shares[self.rank])
            statuses = comm.all_gather_object(st)
            if boss:
                lap("process")
            _check_statuses(statuses, a, b, self.size, self.root)
            s0 = statuses[0]
            if self.empty is None:
                self.empty = np.empty((0,) + tuple(s0.row_shape), np.dtype(s0.dtype))
            if plan["positional"] and self.layout is None:
                self.start_writing(np.dtype(s0.dtype), tuple(s0.row_shape), a)
                if self.write_mode == "parallel":
                    error, _ = self.write_own(a, shares, out)
                    _check_statuses(comm.all_gather_object(Status(error=error)), a, b, self.size, self.root)
            got = None
            if self.write_mode != "parallel":
                got = comm.gather(out, self.root)
                if boss:
                    lap("gather")
            if boss:
                if boss.writer is None:  # a user's callable output runs in the main thread
                    boss.writer = Writer(boss.write, self.overlap and isinstance(boss.sink, (NpyFile, Collect)))
                self.finish_round(a, b, shares, statuses, got)
            for r, s in enumerate(statuses):
                self.rank_rows[r] += s.rows
                self.rank_secs[r] += s.seconds
                self.rank_busy[r] += s.busy
            self.planner.observe([s.rows for s in statuses], [s.busy for s in statuses],
                                 self.empty.dtype.itemsize * int(np.prod(self.empty.shape[1:], dtype=np.int64)))
            self.rounds += 1
            if plan["resume"] and any(s.preempted for s in statuses):
                if boss:
                    boss.writer.finish()
                raise PipelinePreempted(
                    f"pipeline: preempted after row {b} of {rows}; {plan['journal']} records the rounds done: "
                    "run the same command with resume=True (--resume) to continue")
            if nxt is None:
                return
            pos, shares = b, nxt

    # -- after the last round --

    def finish(self):
        """Sync and close every rank's output rows, then root puts the output in place."""
        comm, boss, plan = self.comm, self.boss, self.plan
        error = None
        if self.rows_writer is not None and not boss:
            try:
                self.rows_writer.close()
            except Exception as exc:
                error = ("write", f"closing the output: {describe(exc)}")
            self.rows_writer = None
        if boss and boss.writer is not None:
            boss.writer.finish()
        st = self.status(None, error, 0, 0, 0.0, 0.0, 0)
        _check_statuses(comm.all_gather_object(st), plan["rows"], plan["rows"], self.size, self.root)
        if not boss:
            _raise_pending(comm.broadcast_object(None, self.root), self.root)
            return None
        if boss.pending is None and boss.rows_out != plan["rows"]:
            boss.pending = f"{plan['rows']} rows were read but {boss.rows_out} came back"
        empty = self.empty if self.empty is not None else self._no_rows()
        written = boss.close(boss.pending is None, empty)
        _raise_pending(comm.broadcast_object(boss.pending, self.root), self.root)
        return written

    def abandon(self):
        """After a failure: stop the threads, leave no half-written output and no file open."""
        if self.reader is not None:
            self.reader.close()
        if self.rows_writer is not None and not self.boss:
            try:
                self.rows_writer.close(sync=self.plan["resume"])
            except OSError:
                pass
        if self.boss:
            if self.boss.writer is not None:
                self.boss.writer.close()
            self.boss.sink.close(False, None)
            if self.boss.journal is not None:
                self.boss.journal.close()

    def close(self):
        if self.reader is not None:
            self.reader.close()
        if self.boss and self.boss.writer is not None:
            self.boss.writer.close()


def _now():
    import time

    return time.perf_counter()


def pipeline(fn, source, *, output=None, chunk_rows=None, verify=False, progress=None, comm=None, root=0,
             read="auto", write="auto", balance="even", memory=None, resume=False, task=None, overlap=True):
    """Share the rows of source over the ranks, apply fn on every rank, put the results in output.

    fn(block) -> array with one row per row of block (a numpy array or a
    torch tensor; every rank's must agree in dtype and row shape). It
    also gets empty blocks, when a round has fewer rows than ranks.

    source (used on root only): an array, a path, a source object, or a
    callable returning one of these. output: None to return the results
    as one array on root, a .npy path (made whole-sized, filled in, put
    in place when complete), or a callable(start_row, block) on root.
    chunk_rows: rows per round (default: all at once). verify: recompute
    each round serially on root and compare bitwise (results then go to
    root). progress: True for a bar on stderr, or a callable(done_rows,
    total_rows). read, write, overlap, balance, memory, resume: see the
    module's docstring. task: what a resume journal records as the task
    (default: fn's ``spmd_task``, set by spmd.tasks.build, else its name).

    Returns a :class:`Result` on root and None on other ranks. Raises
    PipelineError on every rank if anything fails on any rank.
    """
    comm = _comm(comm)
    _choice("read", read, READS)
    _choice("write", write, WRITES)
    _choice("balance", balance, BALANCES)
    lap = Laps()
    boss = _Root(comm, fn, verify, lap) if comm.rank == root else None
    plan = comm.broadcast_object(boss and boss.open(source, output, chunk_rows, progress, read, resume, task), root)
    if plan[0] != "ok":
        raise _ERRORS[plan[2]](f"pipeline: on rank {root}: {plan[1]}")
    plan = plan[1]
    plan["journal"] = journal_path(output) if plan["positional"] else None
    run = _Run(comm, fn, root, boss, plan, lap, (read, write, balance, memory, verify, overlap))
    try:
        run.agree()
        run.rounds_loop()
        written = run.finish()
    except BaseException:
        run.abandon()
        raise
    run.close()
    if not boss:
        return None
    return Result(
        rows=plan["rows"],
        rows_out=boss.rows_out,
        ranks=comm.size,
        backend=comm.backend,
        rounds=run.rounds,
        chunk_rows=plan["chunk"],
        row_shape=tuple(run.empty.shape[1:]) if run.empty is not None else (),
        dtype=str(run.empty.dtype) if run.empty is not None else "",
        timings=lap.timings(),
        total_s=lap.total(),
        checksum=boss.out_crc,
        input_checksum=boss.in_crc,
        rows_per_rank=run.rank_rows,
        process_per_rank=run.rank_secs,
        busy_per_rank=run.rank_busy,
        output=written,
        verified=(boss.mismatched == 0) if verify else None,
        mismatched_rows=boss.mismatched,
        first_mismatch=boss.first_bad,
        checksum_kind=run.crc.name,
        read_mode=run.read_mode,
        write_mode=run.write_mode or ("memory" if output is None else "callable"),
        balance=balance,
        overlap=bool(overlap),
        resumed_rows=plan["start"],
        resumed_rounds=plan["rounds_before"],
        notes=tuple(run.notes),
    )


def _raise_pending(message, root):
    if message is not None:
        raise PipelineError(f"pipeline: on rank {root}: {message}")


def _check_statuses(statuses, a, b, size, root):
    """Raise the same error on every rank if anything failed anywhere or the ranks' outputs disagree."""
    _raise_pending(statuses[root].pending, root)
    failed = [(r, s.error) for r, s in enumerate(statuses) if s.error is not None]
    if failed:
        r, (stage, msg) = failed[0]
        more = f" (and on {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
        if stage == "fn":
            raise PipelineError(f"pipeline: fn failed on rank {r} of {size}, rows {a} to {b}: {msg}{more}")
        raise PipelineError(f"pipeline: on rank {r} of {size}: {msg}{more}")
    if len({(s.row_shape, s.dtype) for s in statuses if s.dtype}) > 1:
        listing = "; ".join(f"rank {r}: {s.dtype} rows of shape {s.row_shape}" for r, s in enumerate(statuses))
        raise PipelineError(f"pipeline: fn must return the same dtype and row shape on every rank; got {listing}")


def _differing_rows(got, expect):
    """Return the indices of rows whose bytes differ (every row, if the shapes differ)."""
    if got.shape != expect.shape or got.dtype != expect.dtype:
        return np.arange(max(got.shape[0], expect.shape[0] if expect.ndim else 1))
    n = got.shape[0]
    if n == 0:
        return np.arange(0)
    g = got.reshape(n, -1).view(np.uint8) if got.ndim > 1 else got.reshape(n, 1).view(np.uint8)
    e = expect.reshape(n, -1).view(np.uint8) if expect.ndim > 1 else expect.reshape(n, 1).view(np.uint8)
    return np.flatnonzero((g != e).any(axis=1))
