"""Data-parallel training: one replica per rank, gradients averaged over ranks.

    from spmd.data_parallel import DataParallel
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

Gradients travel in flat buckets of about ``bucket_mb`` megabytes, one
all_reduce per bucket, in reverse parameter order (the order backward
produces them).  With ``overlap=True`` a bucket is sent, asynchronously,
as soon as backward has produced all its gradients, and ``synchronize``
waits for them.  Buckets always leave in the same order on every rank,
so ranks whose graphs differ cannot deadlock.  A parameter that gets no
gradient on a rank counts as zeros there; one that gets none on any rank
keeps ``grad is None``, as in single-process training (and torch's
DistributedDataParallel).  Frozen parameters (``requires_grad=False``)
are broadcast at the start and never communicated.

Also here: :func:`gather_metrics` (per-rank values to the root).
Checkpoints written atomically by the root (:func:`save_checkpoint`,
:func:`atomic_save`) and read by the root for every rank
(:func:`load_checkpoint`) live in :mod:`spmd.checkpoint` and are
importable from here too.

Importing this module imports torch; ``import spmd`` does not import it.
"""

import contextlib
import hashlib

import torch

from .checkpoint import atomic_save, load_checkpoint, save_checkpoint
from .errors import DataParallelError

__all__ = [
    "DataParallel",
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
    from . import comm as global_comm

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
        self.ready = set()  # ids of parameters whose gradient is final (overlap)
        self.handle = None

    @property
    def nbytes(self):
        return self.flat.numel() * self.flat.element_size()

    def pack(self, divisor):
        """Copy the gradients in, zeros for missing ones; compress if asked."""
        for p, (offset, n) in zip(self.params, self.slices):
            part = self.flat[offset : offset + n]
            g = p.grad
            if g is None:
                part.zero_()
            elif g.is_sparse:
                raise DataParallelError("DataParallel supports dense gradients only; got a sparse one")
            else:
                part.copy_(g.reshape(-1))
        if self.wire is None:
            return self.flat
        # Divide before casting down, so that the sum stays within range.
        self.flat.div_(divisor)
        self.wire.copy_(self.flat)
        return self.wire

    def unpack(self, divisor, used):
        """Write the averaged gradients back; leave globally unused ones alone."""
        if self.wire is None:
            self.flat.div_(divisor)
        else:
            self.flat.copy_(self.wire)
        for p, (offset, n) in zip(self.params, self.slices):
            if not used[id(p)]:
                continue
            avg = self.flat[offset : offset + n].view_as(p)
            if p.grad is None:
                p.grad = avg.clone()
            else:
                p.grad.copy_(avg)


class DataParallel:
    """Keep a model identical on every rank by averaging its gradients.

    model: a torch.nn.Module on the CPU, built the same way on every rank.
    comm: the communicator (default: spmd.comm).
    bucket_mb: target size of one gradient all_reduce, in megabytes.
    overlap: send each bucket from a gradient hook while backward runs.
    compress: None, "fp16" or "bf16": the dtype gradients travel in.
    accum_steps: micro-batches per optimizer step (see ``backward``).
    root: the rank whose parameters every rank starts from.
    """

    def __init__(self, model, comm=None, *, bucket_mb=25.0, overlap=False, compress=None,
                 accum_steps=1, root=0):
        if not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise DataParallelError(f"bucket_mb must be a positive number, got {bucket_mb!r}")
        if compress not in COMPRESS:
            raise DataParallelError(f"compress must be one of None, 'fp16', 'bf16', got {compress!r}")
        if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
            raise DataParallelError(f"accum_steps must be an integer >= 1, got {accum_steps!r}")
        self.module = model
        self.comm = _default_comm(comm)
        self.bucket_mb = bucket_mb
        self.overlap = bool(overlap)
        self.compress = None if compress == "none" else compress
        self.accum_steps = accum_steps
        self.params = [p for p in model.parameters() if p.requires_grad]
        order = self.params[::-1]  # backward produces the last layers' gradients first
        self.buckets = [
            _Bucket(i, [order[j] for j in idx], self.compress)
            for i, idx in enumerate(plan_buckets(order, bucket_mb * _MB))
        ]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._sync = True
        self._micro = 0
        self._next = 0  # index of the next bucket to send
        self._hooks = []
        self._check_same_model()
        self.broadcast_parameters(root)
        if self.overlap and self.comm.size > 1:
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

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
        """Gradient hook (overlap): send every bucket that is complete, in order."""
        if not self._sync:
            return
        b = self._bucket_of[id(p)]
        if b.index < self._next or id(p) in b.ready:
            raise DataParallelError(
                "DataParallel: a parameter got a second gradient before the first was "
                "averaged; call synchronize() after each backward (or use dp.backward(loss)), "
                "and run accumulation micro-batches inside no_sync()"
            )
        b.ready.add(id(p))
        while self._next < len(self.buckets):
            nxt = self.buckets[self._next]
            if len(nxt.ready) < len(nxt.params):
                break
            self._send(nxt)

    def _send(self, b):
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
            used = torch.tensor([p.grad is not None for p in self.params], dtype=torch.int32)
            self.comm.all_reduce(used)
            used = {id(p): bool(u) for p, u in zip(self.params, used.tolist())}
            for b in self.buckets:
                b.handle.wait()
                b.unpack(self.divisor, used)
        finally:
            self._reset()

    def _reset(self):
        for b in self.buckets:
            b.ready.clear()
            b.handle = None
        self._next = 0
        self._micro = 0

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
