"""Every rank's side of a pipeline run: agree on the modes, run the rounds, finish together.

:class:`Ranks` is one rank's run: it tells every other what it has (a
copy of a shared source, crc32c, memory) and they all decide the same
read mode, checksum and balance (:meth:`Ranks.agree`); then, round after
round, it reads ahead (:class:`spmd.pipeline.rounds.Reader`), applies fn, writes
its rows or sends them to root, and exchanges a Status with every rank,
so that a failure anywhere is raised alike everywhere
(:func:`check_statuses`); at the end every rank syncs and closes its
rows before root puts the output in place.
"""

import pickle
import socket
import time

import numpy as np

from spmd.pipeline import checksum
from spmd.runtime import preempt
from spmd.pipeline.balance import Planner, free_memory, parse_budget
from spmd.errors import PipelineError, PipelinePreempted, PipelineValueError
from spmd.pipeline.rounds import Reader, Status, Writer, apply, describe
from spmd.pipeline.sinks import Collect, NpyFile, RowWriter

__all__ = ["Ranks", "check_statuses", "raise_pending"]



class Ranks:
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
        raise_pending(self.comm.broadcast_object(boss and boss.pending, self.root), self.root)
        part = self.comm.scatter(parts, self.root)
        if boss:
            lap("scatter")
        return part, None, seconds

    def write_own(self, a, shares, out):
        """Write this rank's output rows at their offsets; return (error, seconds)."""
        t = time.perf_counter()
        try:
            dtype, row_shape = self.layout
            if out.dtype != dtype or tuple(out.shape[1:]) != row_shape:
                raise PipelineValueError(f"fn returned {out.dtype} rows of shape {tuple(out.shape[1:])}; "
                                         f"the output holds {dtype} rows of shape {row_shape}")
            self.rows_writer.write(a + sum(shares[: self.rank]), out)
            if self.plan["resume"]:
                self.rows_writer.sync()
        except Exception as exc:
            return ("write", f"writing rows {a} to {a + sum(shares)}: {describe(exc)}"), time.perf_counter() - t
        return None, time.perf_counter() - t

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

    def finish_round(self, a, b, shares, statuses, got, into=None):
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
        self.mark = time.perf_counter()
        while True:
            a = pos
            b = a + sum(shares)
            nxt = self.planner.plan(rows - b) if b < rows else None
            if nxt is not None:
                self.request(b, nxt)  # read ahead while fn works on this round
            t0 = time.perf_counter()
            part, error, _ = self.obtain(a, shares)
            # waiting for root's scatter is root's time, not this rank's
            waited = time.perf_counter() - t0 if self.read_mode == "root" and not boss else 0.0
            if error is None:
                out, fail, in_crc, out_crc, secs = apply(self.fn, part, self.crc)
                error = fail and ("fn", fail)
            else:
                out, in_crc, out_crc, secs = None, 0, 0, 0.0
            if error is None and self.write_mode == "parallel":
                error, _ = self.write_own(a, shares, out)
            # busy: this rank's time since the last exchange of statuses, everything it did on its own
            # (its share of reading, fn, writing, root's gathering and checks): the speed balance's measure
            busy = time.perf_counter() - self.mark - waited
            st = self.status(out, error, in_crc, out_crc, secs, busy, shares[self.rank])
            statuses = comm.all_gather_object(st)
            self.mark = time.perf_counter()
            if boss:
                lap("process")
            check_statuses(statuses, a, b, self.size, self.root)
            s0 = statuses[0]
            if self.empty is None:
                self.empty = np.empty((0,) + tuple(s0.row_shape), np.dtype(s0.dtype))
            if plan["positional"] and self.layout is None:
                self.start_writing(np.dtype(s0.dtype), tuple(s0.row_shape), a)
                if self.write_mode == "parallel":
                    error, _ = self.write_own(a, shares, out)
                    check_statuses(comm.all_gather_object(Status(error=error)), a, b, self.size, self.root)
            got = into = None
            if self.write_mode != "parallel":  # into one round-sized array on root: no concatenation
                into = np.empty((b - a,) + self.empty.shape[1:], self.empty.dtype) if boss else None
                got = comm.gather(out, self.root, out=into)
                if boss:
                    lap("gather")
            if boss:
                if boss.writer is None:  # a user's callable output runs in the main thread
                    boss.writer = Writer(boss.write, self.overlap and isinstance(boss.sink, (NpyFile, Collect)))
                self.finish_round(a, b, shares, statuses, got, into)
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
            # this round's rows go before the next round's come: two rounds in memory, not three
            part = out = got = into = None
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
        check_statuses(comm.all_gather_object(st), plan["rows"], plan["rows"], self.size, self.root)
        if not boss:
            raise_pending(comm.broadcast_object(None, self.root), self.root)
            return None
        if boss.pending is None and boss.rows_out != plan["rows"]:
            boss.pending = f"{plan['rows']} rows were read but {boss.rows_out} came back"
        empty = self.empty if self.empty is not None else self._no_rows()
        written = boss.close(boss.pending is None, empty)
        raise_pending(comm.broadcast_object(boss.pending, self.root), self.root)
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


def raise_pending(message, root):
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
