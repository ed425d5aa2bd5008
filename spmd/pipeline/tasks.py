"""Per-record computations for :func:`spmd.pipeline.pipeline`, in one registry.

A task is a function ``make(features, seed, stats) -> fn`` registered
under a name (:func:`register`); ``fn(block)`` maps a block of rows to
one output row per input row, and :func:`build` makes it on every rank.
Every row's result must not depend on which other rows share its block
(:func:`fixed_batches` makes a matrix product do that); tasks with
``needs_stats=True`` get the whole input's column statistics
(:func:`column_stats`). docs/pipeline.md ("Tasks") has an example and
the reasons.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Tuple, TypeVar

import numpy as np

from spmd.errors import TaskError

__all__ = [
    "Task",
    "TASKS",
    "BATCH",
    "register",
    "get",
    "names",
    "build",
    "fixed_batches",
    "column_stats",
]

#: A task's fn: a block of rows in, a block of results out.
Fn = Callable[[Any], Any]
#: Column statistics: each column's mean and standard deviation.
Stats = Tuple[np.ndarray, np.ndarray]
#: What a task registers: make(features, seed, stats) -> fn.
Maker = Callable[[int, int, Any], Fn]
M = TypeVar("M", bound=Maker)

#: Rows per fixed-shape micro-batch in fixed_batches.
BATCH = 1024

#: Rows per block read by column_stats; fixed, so the sums do not depend on chunking.
STATS_BLOCK = 65536


@dataclass(frozen=True)
class Task:
    """A named per-record computation: ``make(features, seed, stats) -> fn``."""

    name: str
    make: Maker
    needs_stats: bool = False
    help: str = ""


TASKS: dict[str, Task] = {}


def register(name: str, *, needs_stats: bool = False) -> Callable[[M], M]:
    """Register ``make(features, seed, stats) -> fn`` as task name (a decorator)."""

    def add(make: M) -> M:
        if name in TASKS:
            raise TaskError(f"task {name!r} is already registered")
        doc = (make.__doc__ or "").strip().splitlines()
        TASKS[name] = Task(name, make, needs_stats, doc[0] if doc else "")
        return make

    return add


def get(name: str) -> Task:
    """Return the task registered as name."""
    try:
        return TASKS[name]
    except KeyError:
        raise TaskError(f"unknown task {name!r}; expected one of {', '.join(names())}") from None


def names() -> list[str]:
    """Return the registered task names, sorted."""
    return sorted(TASKS)


def build(name: str, source: Any = None, *, seed: int = 0, comm: Any = None, root: int = 0) -> Fn:
    """Make task name's fn on every rank (collective; source is needed on root only).

    Root reads the number of features from source and, for tasks that
    need them, the column statistics of the whole input; every rank then
    makes the same fn from them.
    """
    from spmd.pipeline.run import on_root, open_source

    task = get(name)

    def describe() -> tuple[int, Stats | None]:
        src = open_source(source)
        if len(src.shape) != 2:
            raise TaskError(f"task {name!r} needs a table of rows and columns, got shape {src.shape}")
        return src.shape[1], column_stats(src) if task.needs_stats else None

    features, stats = on_root(describe, comm=comm, root=root, share=True)
    fn: Fn = task.make(features, seed, stats)
    # what a resume journal records as the task (spmd.pipeline.journal): name, seed and input width
    fn.spmd_task = f"{name} seed {seed} features {features}"  # type: ignore[attr-defined]
    return fn


def fixed_batches(compute: Callable[[np.ndarray], Any], features: int, dtype: Any, batch: int = BATCH) -> Fn:
    """Wrap compute(buffer) -> rows so that it always sees a buffer of one shape.

    Rows are copied into one reused, zero-padded ``(batch, features)``
    buffer of dtype; compute's first n output rows are kept. Every row
    is then computed by the same kernel on the same shape, whatever the
    size of the block around it, which makes a matrix product's result
    for a row independent of how rows were batched. (This rests on the
    kernel treating every row of the buffer alike, as MKL under torch and
    OpenBLAS under numpy do; tests/pipeline/test_tasks.py checks it bitwise.)
    """
    dtype = np.dtype(dtype)
    raw = np.zeros(batch * features * dtype.itemsize + 64, np.uint8)
    offset = -raw.ctypes.data % 64
    buf = raw[offset : offset + batch * features * dtype.itemsize].view(dtype).reshape(batch, features)
    probe = np.asarray(compute(buf))
    row_shape, out_dtype = probe.shape[1:], probe.dtype

    def fn(block: Any) -> np.ndarray:
        block = np.asarray(block)
        if block.ndim != 2 or block.shape[1] != features:
            raise TaskError(f"expected rows of {features} values, got a block of shape {block.shape}")
        out = np.empty((block.shape[0],) + row_shape, out_dtype)
        for i in range(0, block.shape[0], batch):
            n = min(batch, block.shape[0] - i)
            buf[:n] = block[i : i + n]
            buf[n:] = 0
            out[i : i + n] = np.asarray(compute(buf))[:n]
        return out

    return fn


def column_stats(source: Any, block: int = STATS_BLOCK) -> Stats:
    """Return the mean and standard deviation (float64) of every column of source.

    Reads fixed blocks of rows and merges their moments in order
    (Chan et al.), so the result depends on the data alone.
    """
    rows, features = source.shape[0], source.shape[1]
    count, mean, m2 = 0, np.zeros(features), np.zeros(features)
    for a in range(0, rows, block):
        x = np.asarray(source.read(a, min(a + block, rows)), dtype=np.float64)
        n = x.shape[0]
        bmean = x.mean(axis=0)
        bm2 = ((x - bmean) ** 2).sum(axis=0)
        delta = bmean - mean
        total = count + n
        mean = mean + delta * (n / total)
        m2 = m2 + bm2 + delta * delta * (count * n / total)
        count = total
    std = np.sqrt(m2 / count) if count else np.ones(features)
    return mean, np.where(std > 0, std, 1.0)


# -- the tasks --------------------------------------------------------------------------

HIDDEN, OUTPUTS = 64, 8


@register("mlp")
def mlp(features: int, seed: int, stats: Stats | None) -> Fn:
    """A small torch MLP's forward pass (LayerNorm, 2 hidden GELU layers of 64, 8 outputs), float32."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(
        nn.LayerNorm(features),
        nn.Linear(features, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, OUTPUTS),
    ).eval()
    with torch.no_grad():  # weights from seed alone: the same model on every rank
        for layer in model:
            if isinstance(layer, nn.Linear):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) / layer.in_features**0.5)
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=g) * 0.1)

    def forward(buf: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            out: np.ndarray = model(torch.from_numpy(buf)).numpy()
            return out

    batched = fixed_batches(forward, features, np.float32)

    def fn(block: Any) -> Any:
        # One thread: batches this small gain nothing from more, and ranks
        # sharing a machine would fight over cores.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return batched(block)
        finally:
            torch.set_num_threads(threads)

    return fn


@register("standardize", needs_stats=True)
def standardize(features: int, seed: int, stats: Stats | None) -> Fn:
    """Standardise columns with whole-input statistics, then a fixed random projection to 8, float64."""
    if stats is None:
        raise TaskError("task 'standardize' needs the input's column statistics: make it with build()")
    mean, std = (np.asarray(s, np.float64) for s in stats)
    rng = np.random.default_rng([seed, 2])
    projection = rng.standard_normal((features, OUTPUTS)) / OUTPUTS**0.5

    def project(buf: np.ndarray) -> np.ndarray:
        out: np.ndarray = ((buf - mean) / std) @ projection
        return out

    return fixed_batches(project, features, np.float64)


@register("copy")
def copy(features: int, seed: int, stats: Stats | None) -> Fn:
    """The rows unchanged: measures the pipeline's own cost."""
    return lambda block: np.array(block)
