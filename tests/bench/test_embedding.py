"""spmd.bench.embedding: its summary and target arithmetic, and a tiny run of every case (bytes, not times)."""

import pytest
import torch

from spmd.bench import embedding as rb
from spmd.bench.train_worker import load_job as rb_job


def _row(case, ranks, step_ms, wire_mb, repeat=0):
    return {"case": case, "ranks": ranks, "repeat": repeat, "step_ms": step_ms, "wire_mb": wire_mb,
            "forward": 10.0, "backward": 30.0, "sync": 5.0, "optimizer": 2.0, "local_backward": 25.0,
            "comm": 10.0, "other": 1.0, "loss0": 3.5, "params": 1000}


@pytest.mark.unit
def test_words_drawn_by_frequency_favour_the_first_ranks_and_repeat_per_seed():
    job = rb_job()
    seq = job.make_batch(0, 3, 64, 30522, zipf=1.0)[0]
    again = job.make_batch(0, 3, 64, 30522, zipf=1.0)[0]
    assert torch.equal(seq, again)
    tokens = seq[seq != 30522]  # not the [MASK]s
    # P(rank 1) = 1 / H(30522) ~ 0.093; uniform tokens would make it 1 / 30522
    assert 0.04 < (tokens == 0).float().mean() < 0.16
    assert job.make_batch(0, 3, 64, 30522)[0].unique().numel() > 600  # the arithmetic sequences: spread out


@pytest.mark.unit
def test_the_summary_takes_medians_and_the_target_compares_with_the_best_ddp():
    rows = []
    for rep, jitter in enumerate((0.0, 4.0, -2.0)):
        rows += [_row("DataParallel sparse_rows (gloo)", 2, 60.0 + jitter, 10.0, rep),
                 _row("DDP dense embedding (gloo)", 2, 100.0 + jitter, 40.0, rep),
                 _row("DDP sparse embedding (gloo)", 2, 80.0 + jitter, 12.0, rep)]
    s = rb.summary(rows)
    assert s[("DataParallel sparse_rows (gloo)", 2)]["step_ms"] == 60.0
    assert s[("DDP sparse embedding (gloo)", 2)]["spread"] == pytest.approx(6 / 80)
    [(label, met, how)] = rb.targets(s)
    assert met and "0.75x" in how and "80.0 ms" in how  # against the faster DDP form
    slow = rb.summary([_row("DataParallel sparse_rows (gloo)", 2, 70.0, 10.0),
                       _row("DDP sparse embedding (gloo)", 2, 80.0, 12.0)])
    assert not rb.targets(slow)[0][1]  # 0.88x
    text = rb.report({"rows": rows, "model": rb.MODEL, "repeats": 3, "steps": 10, "warmup": 3})
    assert "NOT met" not in text and "DDP dense embedding (gloo)" in text
    losses = {"DataParallel dense": {"first": 10.4, "last10": 8.25}, "DataParallel tokens bf16": {"first": 10.4,
                                                                                                   "last10": 8.5}}
    text = rb.report({"rows": rows, "model": rb.MODEL, "repeats": 3, "steps": 10, "warmup": 3, "loss_steps": 200,
                      "losses": losses})
    assert "loss after 200 steps" in text and "10.4000 -> 8.500000 (+2.5e-01)" in text  # beside dense fp32


@pytest.mark.launcher
@pytest.mark.timeout(400)
def test_a_tiny_run_of_every_case_sends_fewer_bytes_as_rows():
    backends = ("gloo",)  # (mpi's rows: tests/train/test_sparse_rows_jobs.py; each launch here costs seconds)
    rows = rb.measure(ranks=(2,), backends=backends, repeats=1, steps=2, warmup=1,
                      model={"vocab": 3000, "dim": 32, "layers": 1, "global_batch": 16})
    got = {r["case"]: r for r in rows}
    assert set(got) == {c for c, _, _, _ in rb._cases(backends)}
    for r in rows:
        assert r["step_ms"] > 0 and r["wire_mb"] > 0, r
    for b in backends:
        dense, sparse = got[f"DataParallel dense ({b})"], got[f"DataParallel sparse_rows ({b})"]
        half = got[f"DataParallel tokens bf16 ({b})"]
        # 16 x 16 tokens touch at most 256 of the 3,001 rows: the rows are a fraction of the matrix
        assert sparse["wire_mb"] < 0.75 * dense["wire_mb"], (sparse["wire_mb"], dense["wire_mb"])
        assert sparse["wire_mb"] < half["wire_mb"] < dense["wire_mb"]
    assert got["DDP dense embedding (gloo)"]["wire_mb"] == pytest.approx(got["DataParallel dense (gloo)"]["wire_mb"],
                                                                         rel=0.01)


@pytest.mark.launcher
@pytest.mark.timeout(300)
def test_the_crossover_times_both_ways_at_every_fraction_and_names_the_rules_choice():
    from spmd.bench.crossover_worker import FRACTIONS

    found = rb.crossover(ranks=2, backend="gloo", vocab=400, width=8, repeats=2, launcher="spmd")
    assert (found["ranks"], found["backend"], found["vocab"]) == (2, "gloo", 400)
    assert [p["fraction"] for p in found["points"]] == list(FRACTIONS)
    assert all(p["rows_ms"] > 0 and p["dense_ms"] > 0 and p["rule"] in ("rows", "dense") for p in found["points"])
    assert found["points"][0]["rows"] == 2 and "400 x 8 float32, 2 ranks, gloo" in rb.crossover_table(found)
