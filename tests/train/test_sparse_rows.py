"""spmd.train.sparse_rows (DataParallel(sparse_rows=True)) and spmd.train.compress (per parameter, powersgd:R), in-process.

Ranks are threads of this process (tests.support.run_ranks); each rank's
batch touches different rows of the embedding.  Sparse rows must give the
same averages as the dense all_reduce (to float rounding: the rows are
summed in another order) and the same bits on every rank.  Real jobs under
launchers are in test_sparse_rows_jobs.py.
"""

import copy

import pytest
import torch
from torch import nn

from spmd.errors import DataParallelError
from spmd.train.data_parallel import DataParallel
from spmd.train.compress import check_compress, describe, parse_compress
from tests.support import ranks_ok, run_ranks

pytestmark = pytest.mark.unit

VOCAB, DIM = 400, 8


class Tagger(nn.Module):
    """An embedding (dense or sparse gradients), a bag embedding and a head."""

    def __init__(self, sparse=False):
        super().__init__()
        torch.manual_seed(3)
        self.tokens = nn.Embedding(VOCAB, DIM, sparse=sparse)
        self.bag = nn.EmbeddingBag(VOCAB, DIM, mode="sum")
        self.head = nn.Linear(DIM, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.tokens(x).mean(1) + self.bag(x)))


def batch(rank, step=0, n=4, width=5, spread=VOCAB):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, spread, (n, width), generator=g), torch.randn(n, 3, generator=g)


def loss_of(model, x, y):
    return ((model(x) - y) ** 2).mean()


def train(size, sparse_rows, sparse=False, accum=1, overlap=False, steps=2, n=4, **kw):
    """Each rank's (grads after the last step, final parameters, the row weights' last counts)."""
    base = Tagger(sparse)

    def rank(comm):
        model = copy.deepcopy(base)
        dp = DataParallel(model, comm, sparse_rows=sparse_rows, accum_steps=accum, overlap=overlap,
                          bucket_mb=2e-4, **kw)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(steps):
            opt.zero_grad()
            for micro in range(accum):
                x, y = batch(comm.rank * 10 + micro, step, n=n)
                dp.backward(loss_of(model, x, y))
            grads = {n: None if p.grad is None else p.grad.to_dense().clone() for n, p in model.named_parameters()}
            opt.step()
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
        return grads, state, [(w.name, w.rows, w.dense) for w in dp.row_weights], dp

    return ranks_ok(run_ranks(size, rank))[0]


def close(a, b, tol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=tol, atol=tol), (k, (a[k] - b[k]).abs().max())


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("accum,overlap", [(1, False), (2, False), (1, True), (2, True)])
def test_rows_average_like_the_dense_all_reduce_and_alike_on_every_rank(size, accum, overlap):
    rows = train(size, True, accum=accum, overlap=overlap)
    dense = train(size, False, accum=accum, overlap=overlap)
    for r in range(size):
        close(rows[r][0], dense[r][0])  # the gradients of the last step
        close(rows[r][1], dense[r][1])  # the parameters after two steps
        for k in rows[0][1]:  # summed in rank order: the same bits everywhere
            assert torch.equal(rows[r][1][k], rows[0][1][k]), k
    # Each rank sent the rows its micro-batches touched, no more.
    for r in range(size):
        touched = torch.cat([batch(r * 10 + m, 1)[0].reshape(-1) for m in range(accum)]).unique().numel()
        assert dict((n, k) for n, k, _ in rows[r][2]) == {"tokens.weight": touched, "bag.weight": touched}
        assert not any(dense for _, _, dense in rows[r][2])
    assert not dense[0][2]  # without sparse_rows no weight is sent as rows


@pytest.mark.parametrize("size", [2, 3])
def test_sparse_gradients_average_as_sparse_rows(size):
    rows = train(size, True, sparse=True, accum=2)
    dense = train(size, False, sparse=False, accum=2)
    for r in range(size):
        close(rows[r][0], dense[r][0])
        close(rows[r][1], dense[r][1])
    grad = rows[0][3].module.tokens.weight.grad
    touched = torch.cat([batch(r * 10 + m, 1)[0].reshape(-1) for r in range(size) for m in range(2)]).unique()
    assert grad.is_sparse and torch.equal(grad.coalesce().indices()[0], touched)


def test_most_rows_touched_goes_dense_for_that_step_on_every_rank():
    # 2 x 300 tokens touch about 210 of 400 rows on each rank: the rows padded, with their indices,
    # would move more bytes than a ring all_reduce of the matrix.
    rows = train(2, True, n=60, steps=1)
    dense = train(2, False, n=60, steps=1)
    for r in range(2):
        close(rows[r][0], dense[r][0])
        assert [(k, d) for _, k, d in rows[r][2]] == [(0, True), (0, True)]
    few = train(2, True, n=4, steps=1)
    assert [d for _, _, d in few[0][2]] == [False, False]


def test_a_sparse_embedding_without_sparse_rows_is_refused_with_the_fix():
    def rank(comm):
        model = Tagger(sparse=True)
        dp = DataParallel(model, comm)
        x, y = batch(comm.rank)
        dp.backward(loss_of(model, x, y))

    _, errors, _ = run_ranks(2, rank)
    assert all(isinstance(e, DataParallelError) and "sparse_rows=True" in str(e) for e in errors), errors


def test_compression_per_parameter_pattern():
    out = train(2, False, compress={"head.*": "bf16"}, steps=1)
    full = train(2, False, steps=1)
    dp = out[0][3]
    wires = {tuple(n for n, q in dp.module.named_parameters() if any(q is p for p in b.params)): b.wire
             for b in dp.buckets}
    for names, wire in wires.items():  # a bucket holds one wire dtype: the head's travel in bf16
        assert (wire is not None and wire.dtype == torch.bfloat16) == all(n.startswith("head.") for n in names)
    close({k: v for k, v in out[0][0].items() if not k.startswith("head.")},
          {k: v for k, v in full[0][0].items() if not k.startswith("head.")})
    close({k: v for k, v in out[0][0].items() if k.startswith("head.")},
          {k: v for k, v in full[0][0].items() if k.startswith("head.")}, tol=1e-2)
    assert "compress head.*=bf16" in repr(dp)


def test_compressed_rows_stay_close():
    out = train(2, True, compress={"tokens.*": "bf16"}, steps=1)
    full = train(2, False, steps=1)
    close(out[0][0], full[0][0], tol=1e-2)


def test_a_pattern_that_matches_nothing_names_the_parameters():
    _, errors, _ = run_ranks(2, lambda comm: DataParallel(Tagger(), comm, compress={"token.*": "bf16"}))
    for e in errors:  # on every rank, before any collective
        assert isinstance(e, DataParallelError), e
        assert "'token.*' matches no trainable parameter" in str(e) and "tokens.weight" in str(e), e


def test_the_command_line_form():
    assert parse_compress("bf16") == "bf16" and parse_compress("none") is None
    assert parse_compress("tokens.*=bf16, mlm.*=fp16") == {"tokens.*": "bf16", "mlm.*": "fp16"}
    assert describe({"tokens.*": "bf16", "x": None}) == "tokens.*=bf16,x=none"
    for bad, words in (("tokens.*=int8", "maps to 'int8'"), ("=bf16", "is not pattern=dtype"),
                       ("fp8", "compress must be one of")):
        with pytest.raises(DataParallelError, match=words):
            parse_compress(bad)


def test_powersgd_and_its_rank():
    assert parse_compress("powersgd") == "powersgd:4"  # the default rank
    assert parse_compress("powersgd:8") == "powersgd:8" and check_compress("powersgd:02") == "powersgd:2"
    assert parse_compress("encoder.*=powersgd:2,tokens.*=bf16") == {"encoder.*": "powersgd:2", "tokens.*": "bf16"}
    assert check_compress({"head.*": "powersgd"}) == {"head.*": "powersgd:4"}
    for bad in ("powersgd:0", "powersgd:-1", "powersgd:x", "powersgd:", "powersgd:1.5", "head.*=powersgd:0"):
        with pytest.raises(DataParallelError, match=r"must be a positive integer, as in 'powersgd:4'"):
            parse_compress(bad)
    with pytest.raises(DataParallelError, match="'powersgd' or 'powersgd:R'"):  # the names say how to write it
        parse_compress("power")
    _, errors, _ = run_ranks(2, lambda comm: DataParallel(Tagger(), comm, compress="powersgd:0"))
    assert all(isinstance(e, DataParallelError) and "positive integer" in str(e) for e in errors), errors
