"""Data-parallel training: one replica per rank, gradients averaged over ranks.

    from spmd.train.data_parallel import DataParallel
    dp = DataParallel(model)                # rank 0's parameters on every rank
    for x, y in this_ranks_part_of_each_batch:
        loss = loss_fn(model(x), y)
        if dp.backward(loss):               # True once every accum_steps calls
            optimizer.step()
            optimizer.zero_grad()

When ``backward`` returns True (or after ``synchronize()``), every
rank holds the same gradients: the sum over ranks and micro-batches
divided by ``size * accum_steps``, so a mean loss per micro-batch gives
the gradient of the mean over the whole global batch.

Gradients travel in flat buckets of about ``bucket_mb`` megabytes (25;
with overlap a quarter of the model's gradients, 1 to 25, unless the
node has more ranks than CPUs), one all_reduce per bucket, in reverse
parameter order (about the order backward produces them).  With
``overlap=True`` a bucket is sent, asynchronously, as soon as backward
has produced all its gradients, and ``synchronize`` waits for them.
After the first step the buckets follow the order in which rank 0's
backward produced the gradients, and a parameter that got none in the
last step holds no bucket back (one that then gets one after its bucket
left is added in synchronize).  Each gradient hook also tests the
buckets in flight, which is what moves an MPI all_reduce on while
backward runs (MPI progresses only inside its calls), and writes back
the averages that are in.  Buckets always leave in the same order on
every rank, so ranks whose graphs differ cannot deadlock.  A parameter
that gets no gradient on a rank counts as zeros there; one that gets
none on any rank keeps ``grad is None``, as in single-process training
(and torch's DistributedDataParallel).  Frozen parameters
(``requires_grad=False``) are broadcast at the start and never
communicated.

Also here: :func:`gather_metrics` (per-rank values to the root).
Checkpoints written atomically by the root (:func:`save_checkpoint`,
:func:`atomic_save`) and read by the root for every rank
(:func:`load_checkpoint`) live in :mod:`spmd.checkpoint` and are
importable from here too.

Importing this module imports torch; ``import spmd`` does not import it.
"""

import contextlib
import hashlib
import os

import torch

from spmd.train.checkpoint import atomic_save, load_checkpoint, save_checkpoint
from spmd.errors import DataParallelError

__all__ = [
    "DataParallel",
    "auto_bucket_mb",
    "plan_buckets",
    "broadcast_tensors",
    "gather_metrics",
    "atomic_save",
    "save_checkpoint",
    "load_checkpoint",
]

#: Accepted values of ``compress`` and the dtype each puts on the wire.
COMPRESS = {None: None, "none": None, "fp16": torch.float16, "bf16": torch.bfloat16}

_MB = 1 << 20


def _default_comm(comm):
    if comm is not None:
        return comm
    from spmd import comm as global_comm

    return global_comm


def plan_buckets(tensors, bucket_bytes):
    """Group tensors into buckets of at most bucket_bytes, one dtype per bucket.

    Tensors keep their order within each dtype; a tensor larger than
    bucket_bytes gets a bucket of its own, never split.  Returns lists
    of indices into tensors, in the order the buckets were opened.
    """
    if not bucket_bytes > 0:
        raise DataParallelError(f"bucket_bytes must be positive, got {bucket_bytes!r}")
    buckets, current, used = [], {}, {}
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        b = current.get(t.dtype)
        if b is None or (used[t.dtype] and used[t.dtype] + nbytes > bucket_bytes):
            b = []
            buckets.append(b)
            current[t.dtype], used[t.dtype] = b, 0
        b.append(i)
        used[t.dtype] += nbytes
    return buckets


def auto_bucket_mb(params, overlap, crowded=False):
    """Return the default bucket size: 25 MB; with overlap a quarter of the gradients, 1 to 25 MB.

    One all_reduce per 25 MB costs least when nothing overlaps.  With
    overlap, a model smaller than that would travel in one bucket, which
    leaves only at the end of backward: four buckets let three of them go
    while backward runs, and cost few calls (each costs 0.3-1 ms on gloo
    here; with 1-2 MB buckets the calls cost more than they hid).  crowded
    (more ranks on the node than it has CPUs): 25 MB with overlap too.
    Ranks that share cores make every collective a round of waiting for
    descheduled peers, and leave no CPU free to hide communication
    behind: TinyBert at 4 ranks on 2 cores took 8-10 ms more per step in
    5 buckets than in one, overlapped or not (docs/performance.md).
    """
    if not overlap or crowded:
        return 25.0
    total = sum(p.numel() * p.element_size() for p in params) / _MB
    return min(25.0, max(1.0, total / 4))


def broadcast_tensors(tensors, comm=None, root=0, bucket_mb=25.0):
    """Copy root's values into tensors on every rank, a few flat broadcasts at a time."""
    comm = _default_comm(comm)
    tensors = list(tensors)
    if comm.size == 1 or not tensors:
        return tensors
    with torch.no_grad():
        for idx in plan_buckets(tensors, bucket_mb * _MB):
            group = [tensors[i] for i in idx]
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            comm.broadcast(flat, root)
            offset = 0
            for t in group:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n
    return tensors


class _Bucket:
    """Parameters whose gradients travel together in one flat buffer."""

    def __init__(self, index, params, compress):
        self.index = index
        self.params = params
        self.slices = []
        offset = 0
        for p in params:
            self.slices.append((offset, p.numel()))
            offset += p.numel()
        self.flat = torch.zeros(offset, dtype=params[0].dtype)
        wire = COMPRESS[compress]
        compressible = wire is not None and self.flat.is_floating_point()
        self.wire = torch.zeros(offset, dtype=wire) if compressible else None
        # Overlap: ids of parameters whose gradient is final, how many of those
        # expected (not presumed absent) are still to come, whether a presumed
        # absent one came after the bucket left, and whether the result is in.
        self.ready = set()
        self.pending = len(params)
        self.late = self.landed = self.written = False
        self.handle = None
        self.source = None  # (tensor, divisor or None) the averages are read from, once landed
        # Overlap: what a presumed absent parameter's gradient was when the bucket
        # left without it (None: it had none), so that a late one can be added.
        self.sent_as = {}

    @property
    def nbytes(self):
        return self.flat.numel() * self.flat.element_size()

    def pack(self, divisor):
        """Copy the gradients in, zeros for missing ones; compress if asked."""
        wire = self.wire is not None
        for p, (offset, n) in zip(self.params, self.slices):
            part = self.flat[offset : offset + n]
            g = p.grad
            if g is None:
                part.zero_()
            elif g.is_sparse:
                raise DataParallelError("DataParallel supports dense gradients only; got a sparse one")
            elif wire:  # divide before casting down, so that the sum stays within range
                torch.div(g.reshape(-1), divisor, out=part)
            else:
                part.copy_(g.reshape(-1))
        if not wire:
            return self.flat
        self.wire.copy_(self.flat)
        return self.wire

    def land(self, divisor):
        """Once the all_reduce is done: say where the averages are read from.

        Nothing moves here: the sums in flat are divided, or the wire's
        averages widened, as they are copied into the gradients (one pass).
        """
        self.source = (self.flat, divisor) if self.wire is None else (self.wire, None)
        self.landed = True

    def average(self, divisor):
        """Make flat hold the averages themselves (before a late gradient is added to them)."""
        src, div = self.source
        if div is not None:
            self.flat.div_(div)
        else:
            self.flat.copy_(src)
        self.source = (self.flat, None)

    def _early(self, p):
        """Tell whether p's average can be written during backward: its gradient is in and was sent."""
        return id(p) in self.ready and id(p) not in self.sent_as

    def write_early(self):
        """During backward: write the averages of the parameters that have their gradient here.

        Those are used (by this rank), so the used map cannot veto them;
        one the bucket left without is skipped: its gradient may still come.
        """
        self._write(self._early)
        self.written = True

    def unpack(self, divisor, used):
        """Write the averaged gradients back; leave globally unused ones alone."""
        if not self.landed:
            self.land(divisor)
        if self.written:  # the rest only
            self._write(lambda p: used[id(p)] and not self._early(p))
        else:
            self._write(lambda p: used[id(p)])

    def _write(self, which):
        src, div = self.source
        for p, (offset, n) in zip(self.params, self.slices):
            if not which(p):
                continue
            part = src[offset : offset + n].view_as(p)
            if p.grad is None:
                p.grad = part / div if div is not None else part.to(p.dtype, copy=True)
            elif div is not None:
                torch.div(part, div, out=p.grad)
            else:
                p.grad.copy_(part)

    def lateness(self):
        """Return what gradients that came after the bucket left add to it here (zeros elsewhere)."""
        delta = torch.zeros_like(self.flat)
        for p, (offset, n) in zip(self.params, self.slices):
            if id(p) in self.sent_as and id(p) in self.ready:
                before = self.sent_as[id(p)]
                g = p.grad if before is None else p.grad - before
                delta[offset : offset + n].copy_(g.reshape(-1))
        return delta


class DataParallel:
    """Keep a model identical on every rank by averaging its gradients.

    model: a torch.nn.Module on the CPU, built the same way on every rank.
    comm: the communicator (default: spmd.comm).
    bucket_mb: target size of one gradient all_reduce, in megabytes
        (default: 25; with overlap a quarter of the gradients, 1 to 25,
        unless this node has more ranks than CPUs: see auto_bucket_mb).
    overlap: send each bucket from a gradient hook while backward runs.
    compress: None, "fp16" or "bf16": the dtype gradients travel in.
    accum_steps: micro-batches per optimizer step (see ``backward``).
    root: the rank whose parameters every rank starts from.
    """

    def __init__(self, model, comm=None, *, bucket_mb=None, overlap=False, compress=None,
                 accum_steps=1, root=0):
        if bucket_mb is not None and (isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float))
                                      or not bucket_mb > 0):
            raise DataParallelError(f"bucket_mb must be a positive number (or None), got {bucket_mb!r}")
        if compress not in COMPRESS:
            raise DataParallelError(f"compress must be one of None, 'fp16', 'bf16', got {compress!r}")
        if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
            raise DataParallelError(f"accum_steps must be an integer >= 1, got {accum_steps!r}")
        self.module = model
        self.comm = _default_comm(comm)
        self.overlap = bool(overlap)
        self.compress = None if compress == "none" else compress
        self.accum_steps = accum_steps
        self.params = [p for p in model.parameters() if p.requires_grad]
        if bucket_mb is None:
            crowded = getattr(self.comm, "local_size", 1) > (os.cpu_count() or 1)
            bucket_mb = auto_bucket_mb(self.params, self.overlap, crowded)
        self.bucket_mb = bucket_mb
        self._plan(self.params[::-1])  # backward produces the last layers' gradients first
        self._order = None  # overlap: the order the hooks saw, until the buckets follow it
        self._sync = True
        self._micro = 0
        self._next = 0  # index of the next bucket to send
        self._landed = 0  # overlap: buckets before this one are averaged and written back
        # Overlap: ids of the parameters that got no gradient in the last averaged
        # backward; their buckets do not wait for them (see _on_grad).
        self._absent = set()
        self._hooks = []
        self._check_same_model()
        self.broadcast_parameters(root)
        if self.overlap and self.comm.size > 1:
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
            self._order = []

    def _plan(self, order):
        """Group the parameters, taken in order, into buckets."""
        self.buckets = [
            _Bucket(i, [order[j] for j in idx], self.compress)
            for i, idx in enumerate(plan_buckets(order, self.bucket_mb * _MB))
        ]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}

    def __repr__(self):
        return (
            f"<DataParallel {len(self.params)} parameters in {len(self.buckets)} buckets, "
            f"rank {self.comm.rank} of {self.comm.size}, overlap {self.overlap}, "
            f"compress {self.compress}, accum_steps {self.accum_steps}>"
        )

    def __call__(self, *args, **kwargs):
        """Run the wrapped model."""
        return self.module(*args, **kwargs)

    @property
    def divisor(self):
        """What the summed gradients are divided by: size * accum_steps."""
        return self.comm.size * self.accum_steps

    # -- parameters ------------------------------------------------------------

    def _check_same_model(self):
        """Raise on every rank unless every rank has the same parameters and buffers."""
        if self.comm.size == 1:
            return
        parts = [
            f"{kind} {name} {tuple(t.shape)} {t.dtype} {getattr(t, 'requires_grad', False)}"
            for kind, named in (("param", self.module.named_parameters()),
                                ("buffer", self.module.named_buffers()))
            for name, t in named
        ]
        digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()
        digests = self.comm.all_gather_object((digest, len(parts)))
        if len(set(digests)) > 1:
            listing = "; ".join(f"rank {r}: {n} tensors, {d[:12]}" for r, (d, n) in enumerate(digests))
            raise DataParallelError(
                "DataParallel: the model differs between ranks (names, shapes, dtypes or "
                f"requires_grad of parameters and buffers); build it the same way everywhere. {listing}"
            )

    def broadcast_parameters(self, root=0):
        """Copy root's parameters and buffers, frozen ones included, to every rank."""
        tensors = list(self.module.parameters()) + list(self.module.buffers())
        broadcast_tensors(tensors, self.comm, root, self.bucket_mb)

    # -- gradients -------------------------------------------------------------

    def backward(self, loss):
        """Run loss.backward(); every accum_steps-th call also averages the gradients.

        Returns True when the gradients are averaged and the optimizer
        should step, False while gradients are still accumulating.
        """
        self._micro += 1
        last = self._micro >= self.accum_steps
        with contextlib.nullcontext() if last else self.no_sync():
            loss.backward()
        if last:
            self.synchronize()
        return last

    @contextlib.contextmanager
    def no_sync(self):
        """Within this block backward only accumulates gradients locally."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def _on_grad(self, p):
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
        if not self._sync:
            return
        b = self._bucket_of[id(p)]
        if id(p) in b.ready:
            raise DataParallelError(
                "DataParallel: a parameter got a second gradient before the first was "
                "averaged; call synchronize() after each backward (or use dp.backward(loss)), "
                "and run accumulation micro-batches inside no_sync()"
            )
        b.ready.add(id(p))
        if self._order is not None:
            self._order.append(p)
        if b.index < self._next:  # left already: p was presumed absent
            b.late = True
            return
        if id(p) not in self._absent:
            b.pending -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].pending <= 0:
            self._send(self.buckets[self._next])
        self._progress()

    def _progress(self):
        """Land the buckets whose all_reduce is done, oldest first; stop at one still in flight."""
        while self._landed < self._next:
            b = self.buckets[self._landed]
            if not b.handle.is_completed():
                return
            b.handle.wait()
            b.land(self.divisor)
            b.write_early()
            self._landed += 1

    def _send(self, b):
        if self._absent:
            b.sent_as = {id(p): None if p.grad is None else p.grad.detach().clone()
                         for p in b.params if id(p) in self._absent and id(p) not in b.ready}
        b.handle = self.comm.all_reduce(b.pack(self.divisor), async_op=True)
        self._next = b.index + 1

    def synchronize(self):
        """Average gradients over ranks and micro-batches; wait for buckets in flight.

        Every rank must call it the same number of times.
        """
        try:
            if self.comm.size == 1:
                if self.accum_steps > 1:
                    for p in self.params:
                        if p.grad is not None:
                            p.grad.div_(self.accum_steps)
                return
            if not self.params:
                return
            while self._next < len(self.buckets):
                self._send(self.buckets[self._next])
            flags = [p.grad is not None for p in self.params]
            if self._hooks:  # overlap: and the buckets that a late gradient missed
                flags += [b.late for b in self.buckets]
            flags = torch.tensor(flags, dtype=torch.int32)
            self.comm.all_reduce(flags)
            flags = flags.tolist()
            used = {id(p): bool(u) for p, u in zip(self.params, flags)}
            late = [b for b, n in zip(self.buckets, flags[len(self.params):]) if n]
            deltas = [b.lateness() for b in late]  # before unpack overwrites the late gradients
            for b in self.buckets:
                b.handle.wait()
                b.unpack(self.divisor, used)
            for b, delta in zip(late, deltas):  # on every rank alike: add what came late
                self.comm.all_reduce(delta)
                b.average(self.divisor)
                b.flat.add_(delta.div_(self.divisor))
                b.written = False
                b.unpack(self.divisor, used)  # every used one: another rank's lateness changes them here too
            if self._hooks:
                self._absent = {id(p) for b in self.buckets for p in b.params if id(p) not in b.ready}
                if self._order is not None:
                    self._follow(self._order)
        finally:
            self._reset()

    def _follow(self, seen):
        """Rebuild the buckets in the order rank 0's first hooks saw the gradients (once).

        Buckets then fill as backward goes (a layer's own order differs
        from the order its parameters were registered in), so each leaves
        as soon as it can.  Parameters that got no gradient go last.  Every
        rank takes rank 0's order: buckets must be the same everywhere.
        """
        index = {id(p): i for i, p in enumerate(self.params)}
        mine = list(dict.fromkeys(index[id(p)] for p in seen))
        got = set(mine)
        mine += [i for i in reversed(range(len(self.params))) if i not in got]
        order = self.comm.broadcast_object(mine if self.comm.rank == 0 else None)
        self._order = None
        self._plan([self.params[i] for i in order])

    def _reset(self):
        for b in self.buckets:
            b.ready.clear()
            b.pending = sum(id(p) not in self._absent for p in b.params)
            b.late = b.landed = b.written = False
            b.handle = None
            b.sent_as = {}
        self._next = self._landed = 0
        self._micro = 0
        if self._order:  # a step that failed before the buckets followed it: start again
            self._order = []

    def close(self):
        """Remove the gradient hooks; the model stays as it is."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


# -- metrics -------------------------------------------------------------------


def gather_metrics(metrics, comm=None, root=0):
    """Collect each rank's dict of numbers on root.

    Returns ``{name: [value of rank 0, value of rank 1, ...]}`` on root
    and None elsewhere.  Every rank must pass the same names.
    """
    comm = _default_comm(comm)
    got = comm.gather_object({k: float(v) for k, v in metrics.items()}, root)
    if got is None:
        return None
    names = list(got[root])
    for r, m in enumerate(got):
        if sorted(m) != sorted(names):
            raise DataParallelError(
                f"gather_metrics: rank {r} reported {sorted(m)} but rank {root} reported "
                f"{sorted(names)}; every rank must report the same names"
            )
    return {k: [m[k] for m in got] for k in names}
