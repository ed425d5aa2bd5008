"""Embedding gradients sent as the rows a step touched: their indices and values, gathered, summed in rank order.

``DataParallel(model, sparse_rows=True)`` takes every ``nn.Embedding`` (and
``nn.EmbeddingBag``) weight out of the buckets.  Per step: one all_gather of
every rank's row counts, then per weight one all_gather of the row indices
and one of the rows (padded to the largest count); every rank sums them in
rank order, so the result is the same bits everywhere.  The touched rows are
read from the gradient (a sparse one lists them; in a dense one, the rows not
all zero: a tied weight stays right, only less sparse).  Where the rows would
cost more bytes than a ring all_reduce of the matrix (``CROSSOVER``), the
weight goes dense for that step.  docs/training.md, "Sparse rows".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from spmd.train.buckets import COMPRESS

if TYPE_CHECKING:
    from spmd.comms.comm import Comm

__all__ = ["CROSSOVER", "CROSSOVER_DEFAULT", "RowWeight", "RowSender", "embedding_weights"]

#: Rows travel while their padded gather moves at most this many times the bytes of a ring
#: all_reduce of the whole matrix (2 (n-1)/n of it per rank); above, the weight goes dense.  Rows
#: cost three collectives and the sums where the matrix costs one all_reduce, whose speed differs
#: by backend: measured at 2 ranks on 30,522 x 256 (docs/performance.md), rows stop paying at
#: about 35 % of the rows touched on gloo and 12 % on mpi; these switch there at 2 ranks.
CROSSOVER = {"gloo": 0.7, "mpi": 0.25}
#: For another backend (nccl: not measured).
CROSSOVER_DEFAULT = 0.5


def embedding_weights(model: nn.Module) -> list[tuple[str, nn.Parameter, bool]]:
    """(name, weight, makes sparse gradients) of every trainable embedding table of model, each once."""
    names = {id(p): n for n, p in model.named_parameters()}
    found, seen = [], set()
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            w = module.weight
            if w.requires_grad and id(w) not in seen and id(w) in names:
                seen.add(id(w))
                found.append((names[id(w)], w, bool(module.sparse)))
    return found


class RowWeight:
    """One embedding weight whose gradient travels as rows, and what its last step sent.

    sparse: its module makes sparse gradients (``sparse=True``): the average
    is one too, of the rows some rank touched, and it never goes dense (as
    DDP, which sends sparse gradients as they are).  dtype: the dtype name
    its rows travel in (None: its own).
    """

    def __init__(self, name: str, param: nn.Parameter, sparse: bool, dtype: str | None) -> None:
        self.name, self.param, self.sparse = name, param, sparse
        self.sent_dtype = COMPRESS[dtype] if param.is_floating_point() else None
        self.rows = 0  # rows this rank sent in the last step
        self.dense = False  # whether the last step sent the whole matrix instead

    def touched(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This rank's (row indices, rows) of the gradient, or None without one."""
        g = self.param.grad
        if g is None:
            return None
        if g.is_sparse:
            g = g.coalesce()
            return g.indices()[0], g.values()
        # (two reductions: 4 ms for BERT's 30,522 x 256 on one core, where g.ne(0).any(1) took 13)
        idx = (g.amax(dim=1).ne(0) | g.amin(dim=1).ne(0)).nonzero().squeeze(1)
        return idx, g.index_select(0, idx)


class RowSender:
    """Average the gradients of embedding weights by their touched rows (see the module's doc).

    comm: the communicator; weights: the RowWeights; divisor: what the sums
    are divided by (size x accum_steps).  crossover: CROSSOVER of comm's backend.
    """

    def __init__(self, comm: Comm, weights: list[RowWeight], divisor: int) -> None:
        self.comm, self.weights, self.divisor = comm, weights, divisor
        self.crossover = CROSSOVER.get(getattr(comm, "backend", ""), CROSSOVER_DEFAULT)
        # Bytes this rank sent for them in the last step: an all_gather sends its part to each of the
        # n-1 others, a ring all_reduce 2 (n-1)/n of the buffer.
        self.bytes_sent = 0.0

    def synchronize(self) -> None:
        """Average every weight's gradient over the ranks (collective: the same calls on every rank)."""
        self.bytes_sent = 0.0
        if not self.weights:
            return
        mine = [w.touched() for w in self.weights]
        # Per weight: rows here, and whether this rank has a gradient at all.
        counts = torch.tensor([[0 if t is None else t[0].numel(), t is not None] for t in mine], dtype=torch.int64)
        every = torch.stack(self.comm.all_gather(counts.reshape(-1), equal=True))
        every = every.reshape(self.comm.size, len(self.weights), 2)
        others = self.comm.size - 1
        self.bytes_sent += others * counts.nbytes
        for i, (w, t) in enumerate(zip(self.weights, mine)):
            if not every[:, i, 1].any():
                continue  # no rank has a gradient: it stays None, as DataParallel leaves unused parameters
            rows = every[:, i, 0].tolist()
            if self._goes_dense(w, max(rows)):
                self._dense(w)
            else:
                self._rows(w, t, rows)

    def _goes_dense(self, w: RowWeight, top: int) -> bool:
        """Whether the padded rows would cost more than CROSSOVER times a ring all_reduce of the matrix."""
        p, size = w.param, self.comm.size
        esize = w.sent_dtype.itemsize if w.sent_dtype is not None else p.element_size()
        rows_bytes = size * top * (p.shape[1] * esize + 8)
        ring_bytes = 2 * (size - 1) / size * p.numel() * esize
        w.dense = not w.sparse and rows_bytes > self.crossover * ring_bytes
        return w.dense

    def _rows(self, w: RowWeight, t: tuple[torch.Tensor, torch.Tensor] | None, rows: list[int]) -> None:
        p, top = w.param, max(rows)
        w.rows = rows[self.comm.rank]
        idx = torch.zeros(top, dtype=torch.int64)
        vals = torch.zeros((top, p.shape[1]), dtype=p.dtype if w.sent_dtype is None else w.sent_dtype)
        if t is not None and w.rows:
            idx[:w.rows] = t[0]
            # compressed: divided before casting down, so that the sum stays within range
            vals[:w.rows] = t[1] if w.sent_dtype is None else t[1] / self.divisor
        all_idx = self.comm.all_gather(idx, equal=True)
        all_vals = self.comm.all_gather(vals, equal=True)
        self.bytes_sent += (self.comm.size - 1) * (idx.nbytes + vals.nbytes)
        # The sums of the rows some rank touched, one per such row (sorted), in rank order: the
        # same bits on every rank.  Nothing of the size of the matrix is made or read.
        touched = torch.cat([all_idx[r][:k] for r, k in enumerate(rows)]).unique()
        sums = torch.zeros((touched.numel(), p.shape[1]), dtype=p.dtype)
        for r, k in enumerate(rows):
            if k:
                sums.index_add_(0, torch.searchsorted(touched, all_idx[r][:k]), all_vals[r][:k].to(p.dtype))
        if w.sent_dtype is None:
            sums.div_(self.divisor)
        if w.sparse:
            p.grad = torch.sparse_coo_tensor(touched.unsqueeze(0), sums, p.shape, check_invariants=False,
                                             is_coalesced=True)  # unique() sorts
        elif p.grad is None:
            p.grad = torch.zeros_like(p).index_copy_(0, touched, sums)
        else:  # every row not all zero here is one this rank touched: all are overwritten
            p.grad.index_copy_(0, touched, sums)

    def _dense(self, w: RowWeight) -> None:
        """Send the whole matrix (most rows touched somewhere): one all_reduce."""
        p = w.param
        w.rows = 0
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if w.sent_dtype is not None:
            sent = (g / self.divisor).to(w.sent_dtype)
            self.comm.all_reduce(sent)
            self.bytes_sent += _ring(sent.nbytes, self.comm.size)
            g.copy_(sent)
        else:
            self.comm.all_reduce(g)
            self.bytes_sent += _ring(g.nbytes, self.comm.size)
            g.div_(self.divisor)
        p.grad = g


def _ring(nbytes: int, size: int) -> float:
    """Bytes one rank sends in a ring all_reduce of nbytes."""
    return 2 * (size - 1) / size * nbytes
