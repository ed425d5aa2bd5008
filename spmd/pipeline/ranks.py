"""Every rank's side of a pipeline run: agree on the modes, run the rounds, finish together.

:class:`Ranks` is one rank's run: every rank reports what it has and
they all decide the same read mode, checksum and balance
(:meth:`Ranks.agree`, :mod:`spmd.pipeline.agree`); then each round goes
through named steps (:meth:`Ranks.one_round`): read ahead, get this
rank's rows, apply fn, write them or send them to root, exchange a
Status with every rank so that a failure anywhere is raised alike
everywhere (:func:`check_statuses`), root's checks, the tally, the
balance and a preemption. At the end every rank syncs and closes its
rows before root puts the output in place. Root's books are
:class:`spmd.pipeline.root.Root`'s, asked for through its methods.
"""

from __future__ import annotations

import socket
import time

import numpy as np

from spmd.errors import PipelineError, PipelinePreempted, PipelineValueError
from spmd.pipeline import agree
from spmd.pipeline.balance import Planner
from spmd.pipeline.plan import Span
from spmd.pipeline.progress import PerRank
from spmd.pipeline.rounds import Reader, Status, apply, describe
from spmd.runtime import preempt

__all__ = ["Ranks", "check_statuses", "raise_pending"]


class Ranks:
    """One rank's side of a pipeline run: agree on the modes, then the rounds, then the end.

    books is root's :class:`spmd.pipeline.root.Root` on root and None
    elsewhere; root is root's rank.
    """

    def __init__(self, comm, fn, root, books, plan, lap, options):
        self.comm, self.fn, self.root, self.books, self.plan, self.lap = comm, fn, root, books, plan, lap
        self.options = options
        self.verify, self.overlap = options.verify, options.overlap
        self.rank, self.size = comm.rank, comm.size
        self.src = books.src if books else None
        self.reader = self.rows_writer = None
        self.read_mode, self.write_mode, self.notes = "root", None, []
        self.layout = self.empty = None  # the output's (dtype, row shape); an empty block of output rows
        self.per_rank = PerRank(self.size)
        self.rounds, self.mark = 0, 0.0

    # -- before the first round --

    def agree(self):
        """Tell every rank what this one has (a copy of the source, crc32c, memory); decide the modes."""
        mine, src = agree.report(self.plan, self.options, self.rank, self.root)
        if src is not None:
            self.src = src
        reports = self.comm.all_gather_object(mine)
        agree.raise_errors(reports)
        self.read_mode, note = agree.read_mode(self.plan, self.options.read, reports)
        if note:
            self.notes.append(note)
        self.crc = agree.checksum_of(self.plan, reports)
        self.budgets = agree.budgets(reports)
        self.planner = Planner(self.options.balance, self.size, self.plan.chunk, self.plan.in_row_bytes,
                               self.budgets, self.plan.grid)
        reading = self.read_mode == "parallel" or self.rank == self.root
        self.reader = Reader(self.src.read, self.overlap) if reading else None

    # -- the rounds --

    def rounds_loop(self):
        """Run the rounds from the plan's first unfinished row to the last (or until preempted)."""
        span = self.first_round()
        while span is not None:
            span = self.one_round(span)  # its blocks go before the next round's come: two rounds in memory

    def first_round(self):
        """Take a resumed output's layout; plan the first round, ask for its rows; None if no row is left."""
        plan = self.plan
        if plan.positional and plan.layout is not None:  # a resumed output: its layout is known
            dtype, row_shape = np.dtype(plan.layout[0]), tuple(plan.layout[1])
            self.empty = np.empty((0,) + row_shape, dtype)
            self.start_writing(dtype, row_shape, plan.start)
        if plan.start >= plan.rows and not (plan.rows == 0 and plan.start == 0):
            return None
        span = Span.at(plan.start, self.planner.plan(plan.rows - plan.start, plan.start))
        self.request(span)
        self.mark = time.perf_counter()
        return span

    def one_round(self, span):
        """One round in its steps; return the next round's span, or None after the last."""
        nxt = self.read_ahead(span)
        out, statuses = self.process(span)
        self.learn_layout(span, statuses, out)
        got = self.gather(span, out)
        if self.books:
            self.books.finish_round(span, statuses, got, self.crc, self.read_mode == "root")
        self.tally(statuses)
        self.stop_if_preempted(span, statuses)
        return nxt

    def read_ahead(self, span):
        """Plan the next round and ask for its rows, read while fn works on this one; None after the last."""
        rows = self.plan.rows
        if span.stop >= rows:
            return None
        nxt = Span.at(span.stop, self.planner.plan(rows - span.stop, span.stop))
        self.request(nxt)
        return nxt

    def request(self, span):
        """Ask for this rank's rows of span (all of them where root reads them or verifies)."""
        if self.reader is None:
            return
        if self.read_mode == "root" or self.verify and self.rank == self.root:
            self.reader.request(span.start, span.stop)
        else:
            self.reader.request(*span.rows_of(self.rank))

    def process(self, span):
        """Get this rank's rows, apply fn, write its rows (write 'parallel'), exchange Statuses.

        Returns (fn's output or None, every rank's Status); raises alike
        on every rank if anything failed anywhere.
        """
        t0 = time.perf_counter()
        part, error = self.obtain(span)
        # waiting for root's scatter is root's time, not this rank's
        waited = time.perf_counter() - t0 if self.read_mode == "root" and not self.books else 0.0
        if error is None:
            out, fail, in_crc, out_crc, secs = apply(self.fn, part, self.crc)
            error = fail and ("fn", fail)
        else:
            out, in_crc, out_crc, secs = None, 0, 0, 0.0
        if error is None and self.write_mode == "parallel":
            error = self.write_own(span, out)
        # busy: this rank's time since the last exchange of statuses, everything it did on its own
        # (its share of reading, fn, writing, root's gathering and checks): the speed balance's measure
        busy = time.perf_counter() - self.mark - waited
        mine = self.status(out, error, in_crc, out_crc, secs, busy, span.shares[self.rank])
        statuses = self.comm.all_gather_object(mine)
        self.mark = time.perf_counter()
        if self.books:
            self.lap("process")
        check_statuses(statuses, span.start, span.stop, self.size, self.root)
        return out, statuses

    def obtain(self, span):
        """Return (this rank's block, an error reading it or None) for the round span."""
        if self.read_mode == "parallel":
            return self.read_own(span)
        return self.receive(span), None

    def read_own(self, span):
        """read 'parallel': take this rank's rows from the reader (root takes all of them to verify)."""
        done = self.reader.take()
        books = self.books
        if books:
            self.lap("load")
        a, b = span.start, span.stop
        if done.error:
            return self.plan.no_rows(), ("read", done.error)
        block = done.value
        whole = self.verify and books is not None
        want = span.rows if whole else span.shares[self.rank]
        if block.shape[0] != want or tuple(block.shape[1:]) != self.plan.row_shape:
            return self.plan.no_rows(), ("read", f"reading rows {a} to {b} gave shape {block.shape}")
        if not whole:
            return block, None
        books.keep(block)
        off = span.offset(self.rank)
        return block[off : off + span.shares[self.rank]], None

    def receive(self, span):
        """read 'root': root takes the round from its reader and scatters it; return this rank's share."""
        books, parts = self.books, None
        if books:
            done = self.reader.take()
            self.lap("load")
            block = done.value
            if done.error:
                books.fail(done.error)
            elif block.shape[0] != span.rows or tuple(block.shape[1:]) != self.plan.row_shape:
                books.fail(f"reading rows {span.start} to {span.stop} gave shape {block.shape}")
            elif books.pending is None:
                parts = books.share_out(block, span.shares, self.crc)
                self.lap("check")
        raise_pending(self.comm.broadcast_object(books.pending if books else None, self.root), self.root)
        part = self.comm.scatter(parts, self.root)
        if books:
            self.lap("scatter")
        return part

    def write_own(self, span, out):
        """Write this rank's output rows at their offsets; return an error or None."""
        try:
            dtype, row_shape = self.layout
            if out.dtype != dtype or tuple(out.shape[1:]) != row_shape:
                raise PipelineValueError(f"fn returned {out.dtype} rows of shape {tuple(out.shape[1:])}; "
                                         f"the output holds {dtype} rows of shape {row_shape}")
            self.rows_writer.write(span.start + span.offset(self.rank), out)
            if self.plan.resume:
                self.rows_writer.sync()
        except Exception as exc:
            return ("write", f"writing rows {span.start} to {span.stop}: {describe(exc)}")
        return None

    def status(self, out, error, in_crc, out_crc, seconds, busy, rows):
        """This rank's Status for the round (on root with the failure it keeps, if any)."""
        shape, dtype = (tuple(out.shape[1:]), str(out.dtype)) if out is not None else ((), "")
        return Status(error=error, pending=self.books.news() if self.books else None, rows=rows, in_crc=in_crc,
                      row_shape=shape, dtype=dtype, out_crc=out_crc, seconds=seconds, busy=busy,
                      preempted=preempt.flagged())

    def learn_layout(self, span, statuses, out):
        """The output's row layout from the first round; make a .npy output then, and write this round's rows."""
        s0 = statuses[0]
        if self.empty is None:
            self.empty = np.empty((0,) + tuple(s0.row_shape), np.dtype(s0.dtype))
        if self.plan.positional and self.layout is None:
            self.start_writing(np.dtype(s0.dtype), tuple(s0.row_shape), span.start)
            if self.write_mode == "parallel":
                error = self.write_own(span, out)
                check_statuses(self.comm.all_gather_object(Status(error=error)), span.start, span.stop,
                               self.size, self.root)

    def start_writing(self, dtype, row_shape, start):
        """Make the .npy output (root) and decide who writes it: every rank at its offsets, or root."""
        comm, books, write = self.comm, self.books, self.options.write
        parallel = write != "root" and not self.verify
        msg = None
        if books:
            try:
                made = books.start_output(dtype, row_shape, start, self.crc.name)
                msg = ("ok", made) if parallel and made else ("root", getattr(books.sink, "why_root", None))
            except Exception as exc:
                msg = ("error", describe(exc))
        msg = comm.broadcast_object(msg, self.root)
        if msg[0] == "error":
            raise PipelineError(f"pipeline: on rank {self.root}: making the output: {msg[1]}")
        self.layout = (np.dtype(dtype), tuple(row_shape))
        if msg[0] == "root":
            self.notes += root_writes(msg[1], write, self.size)
            self.write_mode = "root"
            return
        self.rows_writer, error = (books.sink.writer, None) if books else open_rows(msg[1])
        bad = [(r, e) for r, e in enumerate(comm.all_gather_object(error)) if e]
        if not bad:
            self.write_mode = "parallel"
            return
        if write == "parallel":
            raise PipelineError(f"pipeline: write='parallel' is impossible: rank {bad[0][0]} cannot write "
                                f"the output ({bad[0][1]}); pass write='auto' to have root write it")
        self.notes.append(f"root writes: rank {bad[0][0]} cannot open the output ({bad[0][1]})")
        if not books and self.rows_writer is not None:
            self.rows_writer.close(sync=False)
        self.rows_writer = None
        self.write_mode = "root"

    def gather(self, span, out):
        """Gather the round's output to root unless every rank wrote its own; return root's blocks."""
        if self.write_mode == "parallel":
            return None
        books = self.books
        # into one round-sized array on root: no concatenation
        into = np.empty((span.rows,) + self.empty.shape[1:], self.empty.dtype) if books else None
        got = self.comm.gather(out, self.root, out=into)
        if books:
            self.lap("gather")
        return got

    def tally(self, statuses):
        """Add every rank's rows and seconds up; tell the balance planner this round's measures."""
        self.per_rank.add(statuses)
        self.planner.observe([s.rows for s in statuses], [s.busy for s in statuses],
                             self.empty.dtype.itemsize * int(np.prod(self.empty.shape[1:], dtype=np.int64)))
        self.rounds += 1

    def stop_if_preempted(self, span, statuses):
        """A resumable run stops after a round in which any rank was told of a preemption."""
        if self.plan.resume and any(s.preempted for s in statuses):
            if self.books:
                self.books.drain()
            raise PipelinePreempted(
                f"pipeline: preempted after row {span.stop} of {self.plan.rows}; {self.plan.journal} records "
                "the rounds done: run the same command with resume=True (--resume) to continue")

    # -- after the last round --

    def finish(self):
        """Sync and close every rank's output rows, then root puts the output in place."""
        comm, books, rows = self.comm, self.books, self.plan.rows
        error = None
        if self.rows_writer is not None and not books:
            try:
                self.rows_writer.close()
            except Exception as exc:
                error = ("write", f"closing the output: {describe(exc)}")
            self.rows_writer = None
        if books:
            books.drain()
        mine = self.status(None, error, 0, 0, 0.0, 0.0, 0)
        check_statuses(comm.all_gather_object(mine), rows, rows, self.size, self.root)
        if not books:
            raise_pending(comm.broadcast_object(None, self.root), self.root)
            return None
        written = books.finish_output(self.empty if self.empty is not None else self.plan.no_rows())
        raise_pending(comm.broadcast_object(books.pending, self.root), self.root)
        return written

    def abandon(self):
        """After a failure: stop the threads, leave no half-written output and no file open."""
        if self.reader is not None:
            self.reader.close()
        if self.rows_writer is not None and not self.books:
            try:
                self.rows_writer.close(sync=self.plan.resume)
            except OSError:
                pass
        if self.books:
            self.books.abandon()

    def close(self):
        """After a run: stop the reader and root's writer threads."""
        if self.reader is not None:
            self.reader.close()
        if self.books:
            self.books.close()


def open_rows(ticket):
    """Open the output root made, from its ticket, and check it is root's; return (writer, error)."""
    try:
        return ticket.open(), None
    except Exception as exc:
        return None, f"{socket.gethostname()}: {describe(exc)}"


def root_writes(why, write, size):
    """The note for an output only root can write (why: the format's reason, or None); refuse write='parallel'."""
    if why and write == "parallel":
        raise PipelineError(f"pipeline: write='parallel' is impossible: {why}; pass write='auto'")
    return [f"root writes: {why}"] if why and size > 1 else []


def raise_pending(message, root):
    """Raise root's kept failure, if any, as every rank's PipelineError."""
    if message is not None:
        raise PipelineError(f"pipeline: on rank {root}: {message}")


def check_statuses(statuses, a, b, size, root):
    """Raise the same error on every rank if anything failed anywhere or the ranks' outputs disagree."""
    raise_pending(statuses[root].pending, root)
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
