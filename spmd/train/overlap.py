"""The bucket scheduler: buckets leave in one order on every rank, from gradient hooks with overlap.

:class:`Scheduler` owns the buckets of a DataParallel and what each does in a
step (a :class:`Flight`: which gradients are in, its all_reduce, its
averages).  With overlap its hook sends every bucket that is complete while
backward runs, tests the ones in flight (which moves MPI on) and writes back
the averages that are in; it learns which parameters get no gradient, so
that their buckets do not wait, and adds late ones in synchronize.  After
the first step the buckets follow the root's backward order.  Without
overlap every bucket leaves at synchronize.  docs/training.md describes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from spmd.errors import DataParallelError
from spmd.train.buckets import make_buckets

if TYPE_CHECKING:
    from collections.abc import Mapping

    from spmd.comms.comm import Comm
    from spmd.train.buckets import Bucket, Source

__all__ = ["Flight", "Scheduler"]


class Flight:
    """One bucket's way through a step: which gradients are in, its all_reduce, its averages."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.index = bucket.index
        # Ids of parameters whose gradient is final, how many of those expected
        # (not presumed absent) are still to come, whether a presumed absent one
        # came after the bucket left, and whether the averages in are written.
        self.ready = set()
        self.pending = len(bucket.params)
        self.late = self.written = False
        self.handle = None
        self.source: Source | None = None  # where the averages are read from, once landed
        # What a presumed absent parameter's gradient was when the bucket left
        # without it (None: it had none), so that a late one can be added.
        self.sent_as = {}

    def reset(self, absent: set[int]) -> None:
        """Make ready for the next step; parameters in absent are not waited for."""
        self.ready.clear()
        self.pending = sum(id(p) not in absent for p in self.bucket.params)
        self.late = self.written = False
        self.handle = None
        self.source = None
        self.sent_as = {}

    def land(self, divisor: int) -> None:
        """Once the all_reduce is done: note where the averages are read from."""
        self.source = self.bucket.source(divisor)

    def _early(self, p):
        """Tell whether p's average can be written during backward: its gradient is in and was sent."""
        return id(p) in self.ready and id(p) not in self.sent_as

    def write_early(self) -> None:
        """During backward: write the averages of the parameters that have their gradient here.

        Those are used (by this rank), so the used map cannot veto them;
        one the bucket left without is skipped: its gradient may still come.
        """
        self.bucket.unpack(self.source, self._early)
        self.written = True

    def unpack(self, divisor: int, used: dict[int, bool]) -> None:
        """Write the averaged gradients back; leave globally unused ones alone."""
        if self.source is None:
            self.land(divisor)
        if self.written:  # the rest only
            self.bucket.unpack(self.source, lambda p: used[id(p)] and not self._early(p))
        else:
            self.bucket.unpack(self.source, lambda p: used[id(p)])

    def lateness(self) -> torch.Tensor:
        """Return what gradients that came after the bucket left add to it here (zeros elsewhere)."""
        b = self.bucket
        delta = torch.zeros_like(b.flat)
        for p, (offset, n) in zip(b.params, b.slices):
            if id(p) in self.sent_as and id(p) in self.ready:
                before = self.sent_as[id(p)]
                g = p.grad if before is None else p.grad - before
                delta[offset : offset + n].copy_(g.reshape(-1))
        return delta

    def add_late(self, delta: torch.Tensor, divisor: int, used: dict[int, bool]) -> None:
        """Add the summed late gradients delta to the averages and write every used one back."""
        self.source = self.bucket.average(self.source)
        self.bucket.flat.add_(delta.div_(divisor))
        self.written = False
        self.unpack(divisor, used)  # every used one: another rank's lateness changes them here too


class Scheduler:
    """Send a DataParallel's buckets in the same order on every rank and write the averages back.

    comm: the communicator; params: the trainable parameters; divisor:
    what the sums are divided by; root: the rank whose backward order the
    buckets follow.  Hooks are installed by :meth:`install_hooks`.
    """

    def __init__(self, comm: Comm, params: list[torch.nn.Parameter], *, bucket_mb: float,
                 compress: str | None | Mapping[int, str | None], divisor: int, root: int) -> None:
        self.comm = comm
        self.params = params
        self.bucket_mb = bucket_mb
        self.compress = compress
        self.divisor = divisor
        self.root = root
        self.plan(params[::-1])  # backward produces the last layers' gradients first
        self.order = None  # overlap: the order the hooks saw, until the buckets follow it
        self.sync = True  # False inside no_sync: the hooks do nothing
        self._next = 0  # index of the next bucket to send
        self._landed = 0  # overlap: buckets before this one are averaged and written back
        # Overlap: ids of the parameters that got no gradient in the last averaged
        # backward; their buckets do not wait for them (see on_grad).
        self._absent = set()
        self._hooks = []

    def plan(self, order: list[torch.nn.Parameter]) -> None:
        """Group the parameters, taken in order, into buckets."""
        self.buckets = make_buckets(order, self.bucket_mb, self.compress)
        self.flights = [Flight(b) for b in self.buckets]
        self._flight_of = {id(p): f for f in self.flights for p in f.bucket.params}

    @property
    def hooked(self) -> bool:
        """Whether the gradient hooks are installed (overlap on more than one rank)."""
        return bool(self._hooks)

    def install_hooks(self) -> None:
        """Send buckets from gradient hooks while backward runs (overlap)."""
        self._hooks = [p.register_post_accumulate_grad_hook(self.on_grad) for p in self.params]
        self.order = []

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- during backward -----------------------------------------------------------

    def on_grad(self, p: torch.nn.Parameter) -> None:
        """Gradient hook (overlap): send every bucket that is complete, in order.

        A bucket is complete when every parameter of it that is expected
        has its gradient: one that got none in the last averaged backward
        (the pooler of a BERT trained on masked tokens only) is presumed
        absent, so its bucket does not wait for the end of backward.  If
        such a gradient comes after its bucket left, synchronize adds it to
        the average in one more all_reduce of that bucket, on every rank
        (each learns which buckets from the used map).  Each hook
        also tests the buckets in flight, oldest first, which drives MPI's
        progress during backward, and writes back the averages that are in.
        """
        if not self.sync:
            return
        f = self._flight_of[id(p)]
        if id(p) in f.ready:
            raise DataParallelError(
                "DataParallel: a parameter got a second gradient before the first was "
                "averaged; call synchronize() after each backward (or use dp.backward(loss)), "
                "and run accumulation micro-batches inside no_sync()"
            )
        f.ready.add(id(p))
        if self.order is not None:
            self.order.append(p)
        if f.index < self._next:  # left already: p was presumed absent
            f.late = True
            return
        if id(p) not in self._absent:
            f.pending -= 1
        while self._next < len(self.flights) and self.flights[self._next].pending <= 0:
            self._send(self.flights[self._next])
        self._progress()

    def _progress(self):
        """Land the buckets whose all_reduce is done, oldest first; stop at one still in flight."""
        while self._landed < self._next:
            f = self.flights[self._landed]
            if not f.handle.is_completed():
                return
            f.handle.wait()
            f.land(self.divisor)
            f.write_early()
            self._landed += 1

    def _send(self, f):
        if self._absent:
            f.sent_as = {id(p): None if p.grad is None else p.grad.detach().clone()
                         for p in f.bucket.params if id(p) in self._absent and id(p) not in f.ready}
        f.handle = self.comm.all_reduce(f.bucket.pack(self.divisor), async_op=True)
        self._next = f.index + 1

    # -- the steps of synchronize ------------------------------------------------------

    def send_rest(self) -> None:
        """Send, in order, every bucket that has not left yet."""
        while self._next < len(self.flights):
            self._send(self.flights[self._next])

    def late_flags(self) -> list[bool]:
        """With hooks: per bucket, whether a gradient came after it left (for the used map)."""
        return [f.late for f in self.flights] if self._hooks else []

    def late(self, flags: list[int]) -> list[Flight]:
        """Return the buckets that flags, summed over ranks, mark late on some rank."""
        return [f for f, n in zip(self.flights, flags) if n]

    def write_back(self, used: dict[int, bool]) -> None:
        """Wait for every bucket and write its averages back to the used parameters."""
        for f in self.flights:
            f.handle.wait()
            f.unpack(self.divisor, used)

    def add_late(self, late: list[Flight], deltas: list[torch.Tensor], used: dict[int, bool]) -> None:
        """Sum each late bucket's deltas over ranks and add them to its averages (on every rank alike)."""
        for f, delta in zip(late, deltas):
            self.comm.all_reduce(delta)
            f.add_late(delta, self.divisor, used)

    def learn(self) -> None:
        """With hooks: note which parameters got no gradient; the first time, follow the root's order."""
        if self._hooks:
            self._absent = {id(p) for f in self.flights for p in f.bucket.params if id(p) not in f.ready}
            if self.order is not None:
                self._follow(self.order)

    def _follow(self, seen):
        """Rebuild the buckets in the order the root's first hooks saw the gradients (once).

        Buckets then fill as backward goes (a layer's own order differs
        from the order its parameters were registered in), so each leaves
        as soon as it can.  Parameters that got no gradient go last.  Every
        rank takes the root's order: buckets must be the same everywhere.
        """
        index = {id(p): i for i, p in enumerate(self.params)}
        mine = list(dict.fromkeys(index[id(p)] for p in seen))
        got = set(mine)
        mine += [i for i in reversed(range(len(self.params))) if i not in got]
        order = self.comm.broadcast_object(mine if self.comm.rank == self.root else None, self.root)
        self.order = None
        self.plan([self.params[i] for i in order])

    def reset(self) -> None:
        """Make every bucket ready for the next step."""
        for f in self.flights:
            f.reset(self._absent)
        self._next = self._landed = 0
        if self.order:  # a step that failed before the buckets followed it: start again
            self.order = []
