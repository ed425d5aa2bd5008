"""A user's script over spmd's public API, type-checked in strict mode by tests/test_typing.py (never run)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import numpy.typing as npt
import torch

import spmd
from spmd import Comm, Handle, comm, finalize, init, initialized
from spmd.checkpoint import load_checkpoint, save_checkpoint
from spmd.data_parallel import DataParallel
from spmd.pipeline import pipeline
from spmd.pipeline.sources import NpySource, ShardSource, SyntheticTable
from spmd.preempt import on_preempt
from spmd.tasks import register


def collectives(c: Comm) -> float:
    x = torch.ones(4) * (c.rank + 1)
    same: torch.Tensor = c.all_reduce(x)
    c.broadcast(x, root=0)
    c.reduce(x, root=0, op="max")
    a: npt.NDArray[np.float64] = np.arange(6.0)
    part = c.scatter([a] * c.size if c.rank == 0 else None, root=0)
    rows = c.gather(a, root=0)
    every = c.all_gather(a)
    blocks = c.all_to_all([a] * c.size)
    prefix = c.scan(a)
    c.barrier()
    handle: Handle[torch.Tensor] = c.all_reduce(x, async_op=True)
    handle.wait()
    total = c.all_gather_object({"rank": c.rank})
    sub = c.split(color=c.rank % 2)
    if c.size > 1:
        c.send(a, dst=(c.rank + 1) % c.size)
        got = c.recv(src=(c.rank - 1) % c.size)
        del got
    del part, rows, every, blocks, prefix, total, sub
    return float(same.sum()) + float(c.size) + float(c.local_rank)


def training(model: torch.nn.Module, path: str) -> None:
    dp = DataParallel(model)
    loss = dp(torch.ones(2, 3)).sum()
    loss.backward()
    dp.synchronize()
    save_checkpoint({"model": model.state_dict()}, path)
    state = load_checkpoint(path)
    del state


@register("double")
def make_double(features: int, seed: int, stats: object) -> Callable[[npt.NDArray[np.float32]], npt.NDArray[np.float32]]:
    return lambda block: block * 2.0


@on_preempt
def save_now() -> None:
    pass


def main() -> None:
    c = init(backend="gloo", timeout=60.0)
    assert initialized()
    collectives(c)
    collectives(comm)
    result = pipeline(lambda block: block * 2.0, SyntheticTable(1000, 4), chunk_rows=100)
    print(result)
    print(NpySource, ShardSource, spmd.SpmdError)
    finalize()
