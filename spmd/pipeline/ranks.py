"""Every rank's side of a pipeline run: agree on the modes, run the rounds, finish together.

:class:`Ranks` is what every rank does alike: every rank reports what it
has and they all decide the same read mode, checksum and balance
(:meth:`Ranks.agree`, :mod:`spmd.pipeline.agree`); then each round goes
through named steps (:meth:`Ranks.one_round`): read ahead, get this
rank's rows, apply fn, write them or send them to root, exchange a
Status with every rank so that a failure anywhere is raised alike
everywhere (:func:`check_statuses`), root's checks, the tally, the
balance and a preemption. At the end every rank syncs and closes its
rows before root puts the output in place. What differs by role is a
method of Ranks that :mod:`spmd.pipeline.roles` overrides: root's part
(its books, :class:`spmd.pipeline.root.Root`) and another rank's.
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

__all__ = ["Ranks", "check_statuses", "raise_pending", "open_rows", "root_writes"]


class Ranks:
    """One rank's side of a pipeline run, what every rank does alike: agree on the modes, the rounds, the end.

    root is root's rank.  Made by :func:`spmd.pipeline.roles.one_rank`, as its RootRank or its OtherRank.
    """

    def __init__(self, comm, fn, root, plan, options):
        self.comm, self.fn, self.root, self.plan = comm, fn, root, plan
        self.options = options
        self.verify, self.overlap = options.verify, options.overlap
        self.rank, self.size = comm.rank, comm.size
        self.src = None
        self.reader = self.rows_writer = None
        self.read_mode, self.write_mode, self.notes = "root", None, []
        self.layout = self.empty = None  # the output's (dtype, row shape); an empty block of output rows
        self.per_rank = PerRank(self.size)
        self.rounds, self.mark = 0, 0.0

    # -- what each role does its own way --

    def lap(self, step):
        """Time the step just done (root's timings; another rank keeps none)."""

    def reads(self):
        """Whether this rank reads from the source, once the read mode is agreed."""
        raise NotImplementedError

    def reads_whole(self):
        """Whether this rank reads every row of a round (root where it reads for all, or verifies)."""
        return False

    def own_rows(self, span, block):
        """This rank's rows of the block it read."""
        return block

    def receive(self, span):
        """read 'root': root scatters the round; return (this rank's share, seconds spent waiting for root)."""
        raise NotImplementedError

    def news(self):
        """The failure root keeps, to tell every rank in this round's Status (None elsewhere)."""
        return None

    def output_ticket(self, dtype, row_shape, start, parallel):
        """Make the .npy output (root): ("ok", ticket), ("root", why) or ("error", text); None elsewhere."""
        return None

    def open_writer(self, ticket):
        """This rank's writer of the output's rows: (writer, None) or (None, why it cannot)."""
        raise NotImplementedError

    def release_writer(self):
        """Root writes after all: let go of this rank's writer."""

    def gather_into(self, span):
        """Where root gathers the round's output (None elsewhere)."""
        return None

    def book(self, span, statuses, got):
        """Root's books of a round: the checks, the output, the journal (nothing elsewhere)."""

    def drain(self):
        """Wait for root's writes of the rounds done (nothing elsewhere)."""

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
        self.reader = Reader(self.src.read, self.overlap) if self.reads() else None

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
        self.book(span, statuses, got)
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
        """Ask for this rank's rows of span (all of them where it reads them for every rank or verifies)."""
        if self.reader is None:
            return
        if self.reads_whole():
            self.reader.request(span.start, span.stop)
        else:
            self.reader.request(*span.rows_of(self.rank))

    def process(self, span):
        """Get this rank's rows, apply fn, write its rows (write 'parallel'), exchange Statuses.

        Returns (fn's output or None, every rank's Status); raises alike
        on every rank if anything failed anywhere.
        """
        if self.read_mode == "parallel":
            (part, error), waited = self.read_own(span), 0.0
        else:
            (part, waited), error = self.receive(span), None  # waiting for root's scatter is root's time
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
        self.lap("process")
        check_statuses(statuses, span.start, span.stop, self.size, self.root)
        return out, statuses

    def read_own(self, span):
        """read 'parallel': take this rank's rows from the reader (all of them where it reads whole)."""
        done = self.reader.take()
        self.lap("load")
        a, b = span.start, span.stop
        if done.error:
            return self.plan.no_rows(), ("read", done.error)
        block = done.value
        want = span.rows if self.reads_whole() else span.shares[self.rank]
        if block.shape[0] != want or tuple(block.shape[1:]) != self.plan.row_shape:
            return self.plan.no_rows(), ("read", f"reading rows {a} to {b} gave shape {block.shape}")
        return self.own_rows(span, block), None

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
        return Status(error=error, pending=self.news(), rows=rows, in_crc=in_crc, row_shape=shape, dtype=dtype,
                      out_crc=out_crc, seconds=seconds, busy=busy, preempted=preempt.flagged())

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
        comm, write = self.comm, self.options.write
        parallel = write != "root" and not self.verify
        msg = comm.broadcast_object(self.output_ticket(dtype, row_shape, start, parallel), self.root)
        if msg[0] == "error":
            raise PipelineError(f"pipeline: on rank {self.root}: making the output: {msg[1]}")
        self.layout = (np.dtype(dtype), tuple(row_shape))
        if msg[0] == "root":
            self.notes += root_writes(msg[1], write, self.size)
            self.write_mode = "root"
            return
        self.rows_writer, error = self.open_writer(msg[1])
        bad = [(r, e) for r, e in enumerate(comm.all_gather_object(error)) if e]
        if not bad:
            self.write_mode = "parallel"
            return
        if write == "parallel":
            raise PipelineError(f"pipeline: write='parallel' is impossible: rank {bad[0][0]} cannot write "
                                f"the output ({bad[0][1]}); pass write='auto' to have root write it")
        self.notes.append(f"root writes: rank {bad[0][0]} cannot open the output ({bad[0][1]})")
        self.release_writer()
        self.rows_writer = None
        self.write_mode = "root"

    def gather(self, span, out):
        """Gather the round's output to root unless every rank wrote its own; return root's blocks."""
        if self.write_mode == "parallel":
            return None
        got = self.comm.gather(out, self.root, out=self.gather_into(span))  # into one round-sized array on root
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
            self.drain()
            raise PipelinePreempted(
                f"pipeline: preempted after row {span.stop} of {self.plan.rows}; {self.plan.journal} records "
                "the rounds done: run the same command with resume=True (--resume) to continue")

    # -- after the last round --

    def finish(self):
        """Sync and close every rank's output rows, then root puts the output in place; root's output."""
        raise NotImplementedError

    def closed_alike(self, error):
        """Every rank says how closing its rows went; raise alike if any failed."""
        rows = self.plan.rows
        check_statuses(self.comm.all_gather_object(self.status(None, error, 0, 0, 0.0, 0.0, 0)), rows, rows,
                       self.size, self.root)

    def abandon(self):
        """After a failure: stop the threads, leave no half-written output and no file open."""
        if self.reader is not None:
            self.reader.close()

    def close(self):
        """After a run: stop the reader (and root's writer threads)."""
        if self.reader is not None:
            self.reader.close()


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
