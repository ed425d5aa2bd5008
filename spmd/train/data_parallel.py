"""Data-parallel training: one replica per rank, gradients averaged over ranks.

    from spmd.train.data_parallel import DataParallel
    dp = DataParallel(model)                # the root's parameters on every rank
    for x, y in this_ranks_part_of_each_batch:
        loss = loss_fn(model(x), y)
        if dp.backward(loss):               # True once every accum_steps calls
            optimizer.step()
            optimizer.zero_grad()

Buckets are planned and packed in :mod:`spmd.train.buckets` and sent by
:mod:`spmd.train.overlap`'s scheduler; checkpoints are :mod:`spmd.train.checkpoint`'s.
docs/training.md describes the averages, buckets, overlap and unused
parameters.  Importing this module imports torch; ``import spmd`` does not.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import TYPE_CHECKING, Any

import torch

from spmd.errors import DataParallelError
from spmd.train.auto import AUTO, MEASURE_STEPS, Candidate, choose, measure, say, summary
from spmd.train.buckets import auto_bucket_mb, broadcast_tensors, default_comm, plan_buckets
from spmd.train.checkpoint import atomic_save, load_checkpoint, save_checkpoint
from spmd.train.compress import check_compress, describe, dtype_names, powersgd_rank
from spmd.train.overlap import Scheduler
from spmd.train.powersgd import DEFAULT_RANK, PowerSGD, compressible
from spmd.train.sparse_rows import RowSender, RowWeight, embedding_weights

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

    from spmd.comms.comm import Comm
    from spmd.train.buckets import Bucket
    from spmd.train.compress import Compress

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


class DataParallel:
    """Keep a model identical on every rank by averaging its gradients.

    model: a torch.nn.Module on the CPU, built the same way on every rank.
    comm: the communicator (default: spmd.comm).
    bucket_mb: target size of one gradient all_reduce, in megabytes
        (default: 25; with overlap a quarter of the gradients, 1 to 25,
        unless this node has more ranks than CPUs: see auto_bucket_mb).
    overlap: send each bucket from a gradient hook while backward runs.
    compress: None, "fp16" or "bf16": the dtype gradients travel in;
        "powersgd" or "powersgd:R": matrices as rank-R factors with error
        feedback (R 4 by default; vectors and small matrices uncompressed:
        spmd.train.powersgd); or a mapping of parameter-name patterns to
        those, the rest uncompressed (``{"tokens.*": "bf16"}``: spmd.train.compress).
    sparse_rows: send the gradient of every ``nn.Embedding`` (and
        ``nn.EmbeddingBag``) as the rows this step touched on each rank,
        gathered and summed in rank order, instead of the whole matrix
        (spmd.train.sparse_rows; dense for a step where the rows would cost more).
    accum_steps: micro-batches per optimizer step (see ``backward``).
    powersgd_start: optimizer steps whose PowerSGD matrices are averaged
        whole before compression begins (default 0; torch's hook's
        ``start_powerSGD_iter``); compress="auto" measures 3 steps
        uncompressed first anyway (spmd.train.auto).
    root: the rank whose parameters every rank starts from, and whose
        backward order the buckets follow with overlap.
    """

    _scheduler: Scheduler  # made, and remade by compress="auto", in _build
    _powersgd: PowerSGD

    def __init__(self, model: torch.nn.Module, comm: Comm | None = None, *, bucket_mb: float | None = None,
                 overlap: bool = False, compress: Compress = None, accum_steps: int = 1,
                 root: int = 0, sparse_rows: bool = False, powersgd_start: int = 0) -> None:
        if bucket_mb is not None and (isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float))
                                      or not bucket_mb > 0):
            raise DataParallelError(f"bucket_mb must be a positive number (or None), got {bucket_mb!r}")
        if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
            raise DataParallelError(f"accum_steps must be an integer >= 1, got {accum_steps!r}")
        if isinstance(powersgd_start, bool) or not isinstance(powersgd_start, int) or powersgd_start < 0:
            raise DataParallelError(f"powersgd_start must be an integer >= 0, got {powersgd_start!r}")
        self.powersgd_start = powersgd_start
        self.module = model
        self.comm = default_comm(comm)
        self.overlap = bool(overlap)
        self.compress = check_compress(compress)
        self.sparse_rows = bool(sparse_rows)
        self.accum_steps = accum_steps
        self.root = root
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
        self._ways = dtype_names(model, self.compress)
        self._tables = embedding_weights(model) if self.sparse_rows else []
        self._as_rows = {id(p) for _, p, _ in self._tables}
        self._bucket_mb = bucket_mb
        # compress="auto": the gradients it chooses for, uncompressed until the choice.
        self._auto = [(n, p) for n, p in model.named_parameters()
                      if p.requires_grad and self._ways[id(p)] == AUTO and id(p) not in self._as_rows]
        self._auto_choice: dict[str, str | None] | None = None if self._auto else {}
        self._measured = 0  # optimizer steps averaged before the choice
        self._build({k: None if v == AUTO else v for k, v in self._ways.items()}, install=False)
        self._micro = 0
        self._check_same_model()
        self.broadcast_parameters()
        if self.overlap and self.comm.size > 1:
            self._scheduler.install_hooks()
        if self._auto and self.comm.size == 1:
            self._apply({n: None for n, _ in self._auto})
            say(self.comm.rank, "spmd: DataParallel compress='auto' on one rank: nothing travels, none chosen")

    def _build(self, ways: dict[int, str | None], install: bool) -> None:
        """Make the PowerSGD, rows and buckets of ways ({id(parameter): form}); install the hooks if asked."""
        old = getattr(self, "_powersgd", None)
        self._powersgd = self._plan_powersgd(ways, self._as_rows)
        if old is not None:
            self._powersgd.adopt(old)
        low_rank = {id(p) for p in self._powersgd.params}
        # What PowerSGD leaves (vectors, small matrices, rows) travels uncompressed.
        dtypes = {k: None if powersgd_rank(v) else v for k, v in ways.items()}
        self._rows = RowSender(self.comm, [RowWeight(n, p, sparse, dtypes[id(p)]) for n, p, sparse in self._tables],
                               self.divisor)
        bucketed = [p for p in self.params if id(p) not in self._as_rows and id(p) not in low_rank]
        bucket_mb = self._bucket_mb
        if bucket_mb is None:
            crowded = getattr(self.comm, "local_size", 1) > (os.cpu_count() or 1)
            bucket_mb = auto_bucket_mb(bucketed, self.overlap, crowded)
        self.bucket_mb = bucket_mb
        if getattr(self, "_scheduler", None) is not None:
            self._scheduler.remove_hooks()
        self._scheduler = Scheduler(self.comm, bucketed, bucket_mb=bucket_mb, compress=dtypes,
                                    divisor=self.divisor, root=self.root)
        if install and self.overlap and self.comm.size > 1:
            self._scheduler.install_hooks()

    def _plan_powersgd(self, dtypes: dict[int, str | None], as_rows: set[int]) -> PowerSGD:
        """The matrices whose compress is powersgd:R and that cost less as factors; the rest go in buckets."""
        named = [(n, p, powersgd_rank(dtypes[id(p)])) for n, p in self.module.named_parameters()
                 if p.requires_grad and id(p) not in as_rows]
        return PowerSGD(self.comm, [(n, p, r) for n, p, r in named if r and compressible(p, r)], self.accum_steps,
                        start=self.powersgd_start)

    @property
    def powersgd(self) -> PowerSGD:
        """The matrices sent as low-rank factors (spmd.train.powersgd), with their E and Q."""
        return self._powersgd

    @property
    def buckets(self) -> list[Bucket]:
        """The buckets, in the order they leave."""
        return self._scheduler.buckets

    @property
    def row_weights(self) -> list[RowWeight]:
        """With sparse_rows: the embedding weights sent as rows (each says what its last step sent)."""
        return self._rows.weights

    @property
    def wire_bytes_of_rows(self) -> float:
        """Bytes this rank sent for the row weights in the last step (spmd.train.sparse_rows.RowSender.bytes_sent)."""
        return self._rows.bytes_sent

    def __repr__(self) -> str:
        rows = f", {len(self.row_weights)} sent as rows" if self.sparse_rows else ""
        rows += f", {len(self._powersgd.params)} as low-rank factors" if self._powersgd.params else ""
        return (
            f"<DataParallel {len(self.params)} parameters in {len(self.buckets)} buckets{rows}, "
            f"rank {self.comm.rank} of {self.comm.size}, overlap {self.overlap}, "
            f"compress {describe(self.compress)}, accum_steps {self.accum_steps}>"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped model."""
        return self.module(*args, **kwargs)

    @property
    def divisor(self) -> int:
        """What the summed gradients are divided by: size * accum_steps."""
        return self.comm.size * self.accum_steps

    # -- parameters ------------------------------------------------------------

    def _check_same_model(self) -> None:
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

    def broadcast_parameters(self, root: int | None = None) -> None:
        """Copy root's parameters and buffers (default: the root's), frozen ones included, to every rank."""
        tensors = list(self.module.parameters()) + list(self.module.buffers())
        broadcast_tensors(tensors, self.comm, self.root if root is None else root, self.bucket_mb)

    # -- gradients -------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> bool:
        """Run loss.backward(); every accum_steps-th call also averages the gradients.

        Returns True when the gradients are averaged and the optimizer
        should step, False while gradients are still accumulating.
        """
        self._micro += 1
        last = self._micro >= self.accum_steps
        with contextlib.nullcontext() if last else self.no_sync():
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        if last:
            self.synchronize()
        return last

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within this block backward only accumulates gradients locally."""
        scheduler = self._scheduler
        before, scheduler.sync = scheduler.sync, False
        try:
            yield
        finally:
            scheduler.sync = before

    def synchronize(self) -> None:
        """Average gradients over ranks and micro-batches; wait for buckets in flight.

        Every rank must call it the same number of times.
        """
        try:
            if self.comm.size == 1:
                self._average_micro_batches()
                return
            scheduler = self._scheduler
            scheduler.send_rest()
            self._rows.synchronize()  # while the buckets are in flight
            if not scheduler.params and not self._powersgd.params:
                return
            used, late = self._agree_on_use()
            self._powersgd.synchronize(used)  # while the buckets are in flight
            deltas = [f.lateness() for f in late]  # before write_back overwrites the late gradients
            scheduler.write_back(used)
            scheduler.add_late(late, deltas, used)
            scheduler.learn()
            if self._auto_choice is None:
                self._measured += 1
                if self._measured >= MEASURE_STEPS:
                    self._decide()
        finally:
            self._reset()

    # -- compress="auto" ----------------------------------------------------------

    @property
    def auto_choice(self) -> dict[str, str | None] | None:
        """With compress="auto": {parameter name: the form chosen}, the same on every rank; None until chosen."""
        return None if self._auto_choice is None else dict(self._auto_choice)

    def _decide(self) -> None:
        """Measure here, choose on rank 0, take its choice everywhere, rebuild; rank 0 says it once."""
        link, costs = measure(self.comm, self._auto)
        candidates = [Candidate(n, p.numel(), DEFAULT_RANK * (p.shape[0] + p[0].numel())
                                if compressible(p, DEFAULT_RANK) else None) for n, p in self._auto]
        decided = choose(link, costs, candidates) if self.comm.rank == 0 else None
        choice, plain_s, chosen_s = self.comm.broadcast_object(decided, 0)
        self._apply(choice)
        say(self.comm.rank, summary(choice, {n: p.numel() for n, p in self._auto}, link, plain_s, chosen_s))

    def _apply(self, choice: dict[str, str | None]) -> None:
        """Send the auto gradients as choice says from the next step on (the buckets, PowerSGD rebuilt)."""
        self._auto_choice = dict(choice)
        ways = {k: choice.get(self._names[k]) if v == AUTO else v for k, v in self._ways.items()}  # rows: none
        self._build(ways, install=True)

    def _average_micro_batches(self) -> None:
        """On one rank: divide the accumulated gradients by accum_steps (PowerSGD compresses them still)."""
        low_rank = {id(p) for p in self._powersgd.params}
        if low_rank:  # divides by accum_steps itself
            self._powersgd.synchronize({id(p): p.grad is not None for p in self._powersgd.params})
        if self.accum_steps > 1:
            for p in self.params:
                if p.grad is not None and id(p) not in low_rank:
                    p.grad.div_(self.accum_steps)

    def _agree_on_use(self) -> tuple[dict[int, bool], list[Any]]:
        """Return which parameters got a gradient on some rank, and the buckets some rank got one late for."""
        params = self._scheduler.params + self._powersgd.params
        got = [p.grad is not None for p in params]
        got += self._scheduler.late_flags()
        counts = torch.tensor(got, dtype=torch.int32)
        self.comm.all_reduce(counts)
        flags = counts.tolist()
        n = len(params)
        used = {id(p): bool(u) for p, u in zip(params, flags)}
        return used, self._scheduler.late(flags[n:])

    # -- checkpoints -----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs besides the model and optimizer: PowerSGD's Q's and every rank's E; auto's choice.

        A collective (every rank calls it; every rank gets the whole): the
        root saves it in the checkpoint beside the model's state.  Empty
        without PowerSGD and auto.
        """
        state = {"powersgd": self._powersgd.state_dict()} if self._powersgd.params else {}
        if self._auto:
            state["auto"] = {"choice": self.auto_choice}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore state_dict()'s output (from load_checkpoint, on every rank) so that training continues alike.

        With compress="auto" the checkpoint's choice is kept (nothing is
        measured again); one written before the choice measures afresh.
        """
        if bool(state.get("auto")) != bool(self._auto):
            raise DataParallelError(
                "DataParallel.load_state_dict: the checkpoint was written "
                f"{'with' if state.get('auto') else 'without'} compress='auto' and this DataParallel runs "
                f"{'with' if self._auto else 'without'} it; resume with the same compress")
        if self._auto:
            choice = state["auto"]["choice"]
            if choice is not None and sorted(choice) != sorted(n for n, _ in self._auto):
                raise DataParallelError(
                    "DataParallel.load_state_dict: the checkpoint's compress='auto' chose for "
                    f"{sorted(choice)}, this model's auto gradients are {sorted(n for n, _ in self._auto)}; "
                    "resume with the same model and compress")
            if choice is not None:
                self._apply(choice)
            elif self._auto_choice is not None:  # measure afresh, as the run that wrote it would have
                self._auto_choice, self._measured = None, 0
                self._build({k: None if v == AUTO else v for k, v in self._ways.items()}, install=True)
        if bool(state.get("powersgd")) != bool(self._powersgd.params):
            raise DataParallelError(
                "DataParallel.load_state_dict: the checkpoint was written "
                f"{'with' if state.get('powersgd') else 'without'} PowerSGD and this DataParallel runs "
                f"{'with' if self._powersgd.params else 'without'} it; resume with the same compress")
        if self._powersgd.params:
            self._powersgd.load_state_dict(state["powersgd"])

    def _reset(self) -> None:
        self._scheduler.reset()
        self._micro = 0

    def close(self) -> None:
        """Remove the gradient hooks; the model stays as it is."""
        self._scheduler.remove_hooks()


# -- metrics -------------------------------------------------------------------


def gather_metrics(metrics: Mapping[str, float], comm: Comm | None = None,
                   root: int = 0) -> dict[str, list[float]] | None:
    """Collect each rank's dict of numbers on root.

    Returns ``{name: [value of rank 0, value of rank 1, ...]}`` on root
    and None elsewhere.  Every rank must pass the same names.
    """
    comm = default_comm(comm)
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
