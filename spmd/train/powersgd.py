"""PowerSGD: each large gradient matrix travels as two thin factors, with error feedback and warm start.

After Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization" (NeurIPS 2019), Algorithms 1 and 2.
For each gradient matrix (more dimensions: the first x the rest), on every rank:

    M = gradient + E      E: what earlier steps did not send (error feedback)
    P = mean over ranks of M Q, made orthonormal   Q: m x R from the last step (warm start)
    Q = mean over ranks of M^T P                   (one all_reduce for all P's, one for all Q's)
    gradient = P Q^T      the same on every rank;  E = M - P Q^T, this rank's own

The first Q is drawn from a generator seeded alike on every rank.  Vectors
and matrices with R (n + m) >= n m go uncompressed (:func:`compressible`).
docs/training.md says when this pays, what it costs and how it is checkpointed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from spmd.errors import DataParallelError

if TYPE_CHECKING:
    from spmd.comms.comm import Comm

__all__ = ["DEFAULT_RANK", "SEED", "compressible", "orthonormalize", "times_q", "transposed_times_p", "PowerSGD"]

#: The rank of the approximation of "powersgd" without ":R".
DEFAULT_RANK = 4

#: Seed of the generator of the first Q's (the same on every rank).
SEED = 0


def _matrix_shape(shape: torch.Size) -> tuple[int, int]:
    return shape[0], shape.numel() // shape[0]


def compressible(p: torch.Tensor, rank: int) -> bool:
    """Tell whether p's gradient costs less as factors of rank `rank`: a matrix (or more) with R (n + m) < n m."""
    if p.dim() < 2 or not p.is_floating_point():
        return False
    n, m = _matrix_shape(p.shape)
    return rank * (n + m) < n * m


def orthonormalize(p: torch.Tensor, tol: float = 1e-6) -> torch.Tensor:
    """Make p's columns orthonormal in place (Gram-Schmidt, twice over for accuracy); return p.

    A column that is (nearly) a combination of the ones before it, less
    than tol of its own length beyond them, becomes zeros rather than its
    rounding noise scaled up (or NaN): a rank-1 gradient at rank 4 keeps
    one column.  Deterministic, so that equal inputs give bitwise equal outputs.
    """
    for i in range(p.shape[1]):
        col = p[:, i]
        before = col.norm()
        for _ in range(2):
            if i:
                done = p[:, :i]
                col -= done @ (done.T @ col)
        after = col.norm()
        if after <= tol * before or after == 0:
            col.zero_()
        else:
            col /= after
    return p


def times_q(m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """M Q, with Q handed to the product as its transpose: 1.4 ms where M @ Q took 5-9 (30,523 x 128, rank 4, one thread)."""
    return torch.mm(m, q.t().contiguous().t())


def transposed_times_p(m: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """M^T P as (P^T M)^T, M read row by row: 2 ms where M.T @ P took 20 (30,523 x 128, rank 4, one thread)."""
    return torch.mm(p.t(), m).t()


class PowerSGD:
    """Average the gradients of some matrices over ranks as rank-R factors, two all_reduces per step.

    comm: the communicator; named: (name, parameter, R) of each matrix to
    compress (:func:`compressible` ones), in the same order on every rank;
    accum_steps: what the local gradient is divided by first; seed: of the
    first Q's; start: steps averaged whole before compression begins (the
    warm-up of torch's ``start_powerSGD_iter``).  State: E (``errors``) and
    Q (``qs``) per parameter, and the steps done (``step``).
    """

    def __init__(self, comm: Comm, named: list[tuple[str, torch.nn.Parameter, int]], accum_steps: int = 1,
                 seed: int = SEED, start: int = 0) -> None:
        self.comm = comm
        self.start = start
        self.step = 0
        self.names = [n for n, _, _ in named]
        self.params = [p for _, p, _ in named]
        self.ranks = [r for _, _, r in named]
        self.accum_steps = accum_steps
        self.generator = torch.Generator().manual_seed(seed)
        self.shapes = [_matrix_shape(p.shape) for p in self.params]
        self.qs = [self._draw(m, r, p.dtype) for (_, m), r, p in zip(self.shapes, self.ranks, self.params)]
        self.errors = [torch.zeros(s, dtype=p.dtype) for s, p in zip(self.shapes, self.params)]

    def _draw(self, m: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(m, rank, generator=self.generator, dtype=dtype)

    def adopt(self, other: PowerSGD) -> None:
        """Take other's E and Q of the matrices both compress alike (compress="auto" rebuilds around them)."""
        mine = {(n, r): i for i, (n, r) in enumerate(zip(self.names, self.ranks))}
        for j, key in enumerate(zip(other.names, other.ranks)):
            if key in mine:
                self.errors[mine[key]], self.qs[mine[key]] = other.errors[j], other.qs[j]
        self.step = other.step

    @property
    def wire_elements(self) -> int:
        """Elements one rank all_reduces in a step where every matrix got a gradient: the P's and the Q's."""
        return sum(r * (n + m) for (n, m), r in zip(self.shapes, self.ranks))

    def synchronize(self, used: dict[int, bool]) -> None:
        """Replace the gradient of every used parameter by the rank-R average; update E and Q.

        used: {id(parameter): whether some rank got a gradient}; a parameter
        no rank used keeps no gradient, and its E and Q stay as they were.
        A rank without a gradient for a used one sends zeros (plus its E).
        """
        todo = [i for i, p in enumerate(self.params) if used[id(p)]]
        self.step += 1
        if not todo:
            return
        if self.step <= self.start:
            self._average_whole(todo)
            return
        with torch.no_grad():
            ms = {i: self._local(i) for i in todo}
            ps = self._all_reduce_mean([times_q(ms[i], self.qs[i]) for i in todo])
            for p in ps:
                orthonormalize(p)
            qs = self._all_reduce_mean([transposed_times_p(ms[i], p) for i, p in zip(todo, ps)])
            for i, p, q in zip(todo, ps, qs):
                self._finish(i, ms[i], p, q)

    def _average_whole(self, todo: list[int]) -> None:
        """A warm-up step: average the gradients of todo uncompressed, in one all_reduce; E stays zero."""
        with torch.no_grad():
            grads = []
            for i in todo:
                g = self.params[i].grad
                if g is not None and g.is_sparse:
                    self._local(i)  # raises, naming the fix
                grads.append(torch.zeros(self.shapes[i], dtype=self.params[i].dtype) if g is None else g)
            flat = torch.cat([g.reshape(-1) for g in grads])
            if self.comm.size > 1:
                self.comm.all_reduce(flat)
            flat.div_(self.comm.size * self.accum_steps)
            offset = 0
            for i in todo:
                param, n = self.params[i], self.params[i].numel()
                if param.grad is None:
                    param.grad = torch.empty_like(param)
                param.grad.copy_(flat[offset : offset + n].view_as(param))
                offset += n

    def _local(self, i: int) -> torch.Tensor:
        """M: this rank's gradient (a mean over its micro-batches) plus its error, as n x m, made in E's place."""
        g = self.params[i].grad
        if g is not None and g.is_sparse:
            raise DataParallelError(
                f"PowerSGD compresses dense gradients; {self.names[i]} has a sparse one: "
                "send it as rows (sparse_rows=True) or leave it out of the powersgd patterns")
        m = self.errors[i]
        if g is not None:
            m.add_(g.reshape(self.shapes[i]), alpha=1 / self.accum_steps)
        return m

    def _finish(self, i: int, m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
        """Write P Q^T as the gradient, leave E = M - P Q^T (M was made in E's place), keep Q for the next step."""
        param = self.params[i]
        if param.grad is None or not param.grad.is_contiguous():
            param.grad = torch.empty_like(param, memory_format=torch.contiguous_format)
        approx = param.grad.view(self.shapes[i])
        torch.matmul(p, q.T, out=approx)
        m.sub_(approx)
        # A zero column of Q (P had fewer independent columns than R) would stay
        # zero for ever under warm start: draw it again, alike on every rank.
        dead = (q == 0).all(dim=0)
        if dead.any():
            fresh = self._draw(q.shape[0], q.shape[1], q.dtype)
            q[:, dead] = fresh[:, dead]
        self.qs[i] = q

    def _all_reduce_mean(self, mats: list[torch.Tensor]) -> list[torch.Tensor]:
        """All_reduce mats in one flat buffer; return the means, each its own contiguous matrix."""
        flat = torch.cat([t.reshape(-1) for t in mats])
        self.comm.all_reduce(flat)
        flat.div_(self.comm.size)
        out, offset = [], 0
        for t in mats:
            out.append(flat[offset : offset + t.numel()].view(t.shape).to(t.dtype, copy=True))
            offset += t.numel()
        return out

    # -- checkpoints -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Q's and the generator (the same on every rank) and every rank's E, gathered: a collective."""
        errors = self.comm.all_gather_object({n: e for n, e in zip(self.names, self.errors)})
        return {"names": list(self.names), "ranks": list(self.ranks), "qs": dict(zip(self.names, self.qs)),
                "errors": errors, "generator": self.generator.get_state(), "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take Q's, the generator and this rank's E from state_dict()'s output (the same world size)."""
        if state["names"] != self.names or state["ranks"] != self.ranks:
            raise DataParallelError(
                "DataParallel.load_state_dict: the checkpoint's PowerSGD matrices "
                f"{list(zip(state['names'], state['ranks']))} differ from this model's "
                f"{list(zip(self.names, self.ranks))}; resume with the same model and compress")
        if len(state["errors"]) != self.comm.size:
            raise DataParallelError(
                f"DataParallel.load_state_dict: the checkpoint holds PowerSGD's errors of "
                f"{len(state['errors'])} ranks, this job has {self.comm.size}; resume with as many ranks, "
                "or drop state['data_parallel'] to start error feedback afresh")
        mine = state["errors"][self.comm.rank]
        self.errors = [mine[n].clone() for n in self.names]
        self.qs = [state["qs"][n].clone() for n in self.names]
        self.generator.set_state(state["generator"])
        self.step = state.get("step", self.start)  # written before steps were counted: past any warm-up
