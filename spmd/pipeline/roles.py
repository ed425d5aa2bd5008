"""Each role's part of a pipeline run: root's (:class:`RootRank`) and another rank's (:class:`OtherRank`).

Both are :class:`spmd.pipeline.ranks.Ranks`, which runs the rounds alike on
every rank and asks its role, through the methods these override, what
differs: root reads for every rank where they do not, keeps the books
(:class:`spmd.pipeline.root.Root`), makes and completes the output and
times the steps; another rank reads its own rows or takes root's share,
and writes its own rows or sends them.  ``one_rank`` picks the role, once.
"""

from __future__ import annotations

import time

import numpy as np

from spmd.pipeline.ranks import Ranks, open_rows, raise_pending
from spmd.pipeline.rounds import describe

__all__ = ["one_rank", "RootRank", "OtherRank"]


def one_rank(comm, fn, root, books, plan, lap, options) -> Ranks:
    """This rank's side: root's (books: its :class:`spmd.pipeline.root.Root`, lap: its timer) or another's
    (books None)."""
    if books is not None:
        return RootRank(comm, fn, root, books, plan, lap, options)
    return OtherRank(comm, fn, root, plan, options)


class RootRank(Ranks):
    """Root's side: it reads for every rank where they do not, keeps the books, makes and completes the output."""

    def __init__(self, comm, fn, root, books, plan, lap, options):
        super().__init__(comm, fn, root, plan, options)
        self.books, self._lap = books, lap
        self.src = books.src

    def lap(self, step):
        self._lap(step)

    def reads(self):
        return True

    def reads_whole(self):
        return self.read_mode == "root" or self.verify

    def own_rows(self, span, block):
        if not self.verify:
            return block
        self.books.keep(block)
        off = span.offset(self.rank)
        return block[off : off + span.shares[self.rank]]

    def receive(self, span):
        books, parts = self.books, None
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
        raise_pending(self.comm.broadcast_object(books.pending, self.root), self.root)
        part = self.comm.scatter(parts, self.root)
        self.lap("scatter")
        return part, 0.0

    def news(self):
        return self.books.news()

    def output_ticket(self, dtype, row_shape, start, parallel):
        books = self.books
        try:
            made = books.start_output(dtype, row_shape, start, self.crc.name)
            return ("ok", made) if parallel and made else ("root", getattr(books.sink, "why_root", None))
        except Exception as exc:
            return ("error", describe(exc))

    def open_writer(self, ticket):
        return self.books.sink.writer, None

    def gather_into(self, span):
        return np.empty((span.rows,) + self.empty.shape[1:], self.empty.dtype)

    def book(self, span, statuses, got):
        self.books.finish_round(span, statuses, got, self.crc, self.read_mode == "root")

    def drain(self):
        self.books.drain()

    def finish(self):
        books = self.books
        books.drain()
        self.closed_alike(None)
        written = books.finish_output(self.empty if self.empty is not None else self.plan.no_rows())
        raise_pending(self.comm.broadcast_object(books.pending, self.root), self.root)
        return written

    def abandon(self):
        super().abandon()
        self.books.abandon()

    def close(self):
        super().close()
        self.books.close()


class OtherRank(Ranks):
    """Another rank's side: it reads its own rows or takes root's share, writes its own rows or sends them."""

    def reads(self):
        return self.read_mode == "parallel"

    def receive(self, span):
        began = time.perf_counter()
        raise_pending(self.comm.broadcast_object(None, self.root), self.root)
        part = self.comm.scatter(None, self.root)
        return part, time.perf_counter() - began

    def open_writer(self, ticket):
        return open_rows(ticket)

    def release_writer(self):
        if self.rows_writer is not None:
            self.rows_writer.close(sync=False)

    def finish(self):
        error = None
        if self.rows_writer is not None:
            try:
                self.rows_writer.close()
            except Exception as exc:
                error = ("write", f"closing the output: {describe(exc)}")
            self.rows_writer = None
        self.closed_alike(error)
        raise_pending(self.comm.broadcast_object(None, self.root), self.root)
        return None

    def abandon(self):
        super().abandon()
        if self.rows_writer is not None:
            try:
                self.rows_writer.close(sync=self.plan.resume)
            except OSError:
                pass
