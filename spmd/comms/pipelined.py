"""Large broadcasts as a pipelined chain and large all_gathers as a ring, on the backend's point to point.

gloo's broadcast sends root's whole array to each rank in turn, so root's one
link carries it size-1 times; here root sends it, in pieces, to the next rank
only, which passes each piece on while the next arrives: every link carries
the array once and all work at once.  gloo's all_gather leaves each link
half idle; here each rank sends a block to the next rank while it receives
one from the one before, size-1 steps, each piece sent on as soon as it came.
Both copy bytes, so their results equal the backend's own bit for bit.

:func:`pieces`, :func:`chain` and :func:`ring` are the plan (pure);
:func:`wanted` and :func:`nbytes` decide when; :class:`Pipelined` runs them
in one thread of their own (:mod:`spmd.comms.stages`) as part of the one
call the communicator numbered.  When, and what it gains: docs/comms.md and
docs/performance.md, "Collectives at the link's limit".
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from spmd.comms.arrays import contiguous
from spmd.comms.handle import Handle
from spmd.comms.p2p.incoming import TAG_STRIDE
from spmd.comms.stages import Stages

if TYPE_CHECKING:
    from spmd.comms.contract import Backend

__all__ = ["Pipelined", "pieces", "chain", "ring", "wanted", "nbytes", "MIN_BYTES", "PIECE", "TAG", "CAN",
           "BY_DEFAULT"]

#: Broadcasts and all_gathers (all blocks together) of at least this many bytes take the chain and
#: the ring; below, the backend's own (docs/performance.md, "Collectives at the link's limit").
MIN_BYTES = 4 << 20
#: Bytes of each message: a rank passes a piece on once it has it whole.
PIECE = 1 << 20
#: The backend tag of these messages: a multiple of TAG_STRIDE, which no user's message carries
#: (spmd.comms.p2p sends user tag t as TAG_STRIDE * t + 1..4), and none of the gloo backend's own.
TAG = 0x5360
assert TAG % TAG_STRIDE == 0

#: Backends that can take them (SPMD_PIPELINED=on): the ones with point to point on the CPU.
CAN = frozenset(("gloo", "mpi"))
#: Those that take them with SPMD_PIPELINED=auto, by measurement (docs/performance.md).
BY_DEFAULT = frozenset(("gloo",))


def pieces(n: int, piece: int = PIECE) -> list[tuple[int, int]]:
    """Cut n bytes into (start, stop) spans of at most piece bytes, in order; none for 0."""
    return [(a, min(a + piece, n)) for a in range(0, n, piece)]


def chain(rank: int, size: int, root: int) -> tuple[int | None, int | None]:
    """The ranks rank receives from and sends to in the chain root, root+1, ..., root-1 (None: none).

    Rank order from root, so ranks on one host (numbered together by every
    launcher) pass the array among themselves and it crosses each host's
    link about once.
    """
    place = (rank - root) % size
    before = (rank - 1) % size if place > 0 else None
    after = (rank + 1) % size if place < size - 1 else None
    return before, after


def ring(rank: int, size: int) -> list[tuple[int, int]]:
    """The blocks rank sends to rank+1 and receives from rank-1 at each of the size-1 steps.

    Step s sends block rank-s (its own first, then the one received at step s-1)
    and receives block rank-s-1.
    """
    return [((rank - s) % size, (rank - s - 1) % size) for s in range(size - 1)]


def wanted(mode: str, backend: str, size: int, num_nodes: int | None) -> bool:
    """Whether a communicator should take the chain and the ring for its large arrays.

    mode is SPMD_PIPELINED's; a backend that can, and under auto one that
    gains, on more than one node where the placement knows (None: unknown).
    """
    if mode == "off" or size < 2 or backend not in CAN:
        return False
    if mode == "on":
        return True
    return backend in BY_DEFAULT and num_nodes != 1


def nbytes(x: Any, rows: int | None = None) -> int:
    """The bytes of x, or of rows rows like x's, when x is a CPU numpy array or torch tensor of at least
    one dimension; else 0."""
    if type(x) is np.ndarray:
        shape, item = x.shape, x.itemsize
    else:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(x, torch.Tensor) or not x.is_cpu:
            return 0
        shape, item = tuple(x.shape), x.element_size()
    if not shape:
        return 0
    for d in shape[1:]:
        item *= d
    return item * (shape[0] if rows is None else rows)


def _chain(b: Backend, data: np.ndarray, root: int) -> None:
    """Root's bytes into data on every rank: each piece received from the rank before, then sent on."""
    before, after = chain(b.rank, b.size, root)
    spans = pieces(len(data))
    got = [b.recv(data[a:z], before, TAG, True) for a, z in spans] if before is not None else None
    sent = []
    for i, (a, z) in enumerate(spans):
        if got is not None:
            got[i].wait()
        if after is not None:
            sent.append(b.send(data[a:z], after, TAG, True))
    for s in sent:
        s.wait()


def _ring(b: Backend, blocks: Sequence[np.ndarray]) -> None:
    """Every rank's block (bytes; this rank's already in place) into blocks, around the ring."""
    size, rank = b.size, b.rank
    after, before = (rank + 1) % size, (rank - 1) % size
    steps = ring(rank, size)
    got = [[b.recv(blocks[r][a:z], before, TAG, True) for a, z in pieces(len(blocks[r]))] for _, r in steps]
    sent = []
    for s, (r, _) in enumerate(steps):
        for i, (a, z) in enumerate(pieces(len(blocks[r]))):
            if s:
                got[s - 1][i].wait()  # block r came at the step before: pass each piece on once whole
            sent.append(b.send(blocks[r][a:z], after, TAG, True))
    for w in got[-1]:
        w.wait()
    for w in sent:
        w.wait()


class Pipelined:
    """A communicator's large broadcasts (a chain) and all_gathers (a ring), on its backend's point to point.

    Every call runs in one thread of its own, in the order the ranks made
    them, so an async call returns at once; ``close()`` ends the thread.
    """

    def __init__(self, backend: Backend) -> None:
        self._b = backend
        self._stages: Stages | None = None

    def chains(self, x: Any) -> bool:
        """Whether a broadcast of x takes the chain: 3 ranks or more (with 2 it is the plain one) and large."""
        return self._b.size >= 3 and nbytes(x) >= MIN_BYTES

    def rings(self, x: Any, rows: int | None = None) -> bool:
        """Whether an all_gather of rows rows like x's in all (None: x's on every rank) takes the ring."""
        n = nbytes(x) * self._b.size if rows is None else nbytes(x, rows)
        return n >= MIN_BYTES

    def _submit(self, fn, finish, async_op: bool):
        if self._stages is None:
            self._stages = Stages("spmd-pipelined")
        job = self._stages.submit(fn)
        if async_op:
            return Handle(job.wait, job.test, finish)
        job.wait()
        return finish()

    def broadcast(self, x, root: int, async_op: bool):
        """Copy root's x into x on every rank, down the chain (the hook its Comm's broadcast runs)."""
        c, back = contiguous(x)
        data = self._b.bytes_of(c)

        def finish():
            if back is not None:
                back()
            return x

        return self._submit(lambda: _chain(self._b, data, root), finish, async_op)

    def all_gather(self, x, lengths: Sequence[int], out, async_op: bool):
        """Every rank's x as a list in rank order (views of out when given), around the ring."""
        numpy = type(x) is np.ndarray
        shape = (sum(lengths),) + tuple(x.shape[1:])
        if out is not None:
            full = out
        elif numpy:
            full = self._b.caches.results.empty(("pipelined", "numpy", x.dtype, shape), shape, np.empty, shape,
                                                x.dtype)
        else:
            import torch

            full = self._b.caches.results.empty(("pipelined", "torch", x.dtype, shape), shape,
                                                lambda: torch.empty(shape, dtype=x.dtype))
        blocks, start = [], 0
        for n in lengths:
            blocks.append(full[start : start + n])
            start += n
        mine = blocks[self._b.rank]
        if numpy:
            np.copyto(mine, x)
        else:
            mine.copy_(x.detach())
        data = [self._b.bytes_of(p) for p in blocks]
        return self._submit(lambda: _ring(self._b, data), lambda: blocks, async_op)

    def close(self) -> None:
        """End the thread (at finalize)."""
        stages, self._stages = self._stages, None
        if stages is not None:
            stages.stop()
