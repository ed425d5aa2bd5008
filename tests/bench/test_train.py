"""spmd.bench.train: the summary's arithmetic, and every case of a tiny run.

No timing is asserted: only that every case ran, times are positive, a
step's parts add up to about the step, and DDP and DataParallel start
from the same parameters on the same data (the same loss at step 0).
"""

import json

import pytest

from tests.support import MPIRUN, PY, clean_env, run
from spmd.bench import train as tb


def _row(case, ranks, step_ms, sync=0.0, comm=0.0, repeat=0, loss0=3.5):
    return {"case": case, "ranks": ranks, "repeat": repeat, "step_ms": step_ms, "forward": 10.0,
            "local_backward": 20.0, "backward": 20.0 + comm - sync, "sync": sync, "comm": comm,
            "optimizer": 5.0, "other": 1.0, "loss0": loss0}


@pytest.mark.unit
def test_summary_medians_spread_ratios_and_hidden_fractions():
    rows = []
    for rep, jitter in enumerate((0.0, 2.0, -1.0)):
        rows.append(_row("DDP gloo", 2, 100.0 + jitter, comm=30.0, repeat=rep))
        rows.append(_row("spmd gloo", 2, 80.0 + jitter, sync=20.0, comm=20.0, repeat=rep))
        rows.append(_row("spmd gloo overlap", 2, 70.0 + jitter, sync=5.0, comm=12.0, repeat=rep))
        rows.append(_row("spmd mpi", 2, 50.0, sync=10.0, comm=10.0, repeat=rep))
        rows.append(_row("spmd mpi overlap", 2, 55.0, sync=6.0, comm=8.0, repeat=rep))
    s = tb.summary(rows)
    ddp = s[("DDP gloo", 2)]
    assert ddp["step_ms"] == 100.0 and ddp["min_ms"] == 99.0 and ddp["max_ms"] == 102.0
    assert ddp["spread"] == pytest.approx(0.03) and ddp["within_5pct"] and ddp["repeats"] == 3
    assert ddp["stability"] == pytest.approx(0.01)  # leaving out 99 moves the median to 101
    assert s[("spmd gloo", 2)]["vs_ddp"] == pytest.approx(100 / 80)
    assert s[("spmd mpi", 2)]["vs_ddp"] == 2.0 and s[("spmd mpi", 2)]["spread"] == 0
    assert ddp["vs_ddp"] == 1.0
    h = tb.hidden(s, "gloo", 2)
    assert h["by_wait"] == pytest.approx(1 - 5 / 20) and h["net"] == pytest.approx(1 - 12 / 20)
    assert h["time_ratio"] == pytest.approx(70 / 80)
    m = tb.hidden(s, "mpi", 2)
    assert m["by_wait"] == pytest.approx(0.4) and m["time_ratio"] == pytest.approx(1.1)
    assert tb.hidden(s, "gloo", 4) is None
    got = {label: ok for label, ok, _ in tb.targets(s)}
    assert got["spmd gloo at least as fast as DDP gloo (>= 1.00x)"]
    assert got["spmd mpi at least 1.15x DDP gloo"]
    assert got["overlap on gloo hides at least half the communication"]
    assert not got["overlap on mpi hides at least half the communication"]  # 40%
    assert got["overlap on gloo never slower than without"]
    assert not got["overlap on mpi never slower than without"]  # 1.1x
    wide = tb.summary([_row("spmd gloo", 2, 100.0), _row("spmd gloo", 2, 110.0, repeat=1)])
    assert wide[("spmd gloo", 2)]["spread"] == pytest.approx(10 / 105) and not wide[("spmd gloo", 2)]["within_5pct"]
    assert wide[("spmd gloo", 2)]["vs_ddp"] is None


@pytest.mark.unit
def test_each_repeat_runs_every_case_once_in_an_order_rotated_by_one(monkeypatch):
    seen = []
    monkeypatch.setattr(tb, "launch", lambda impl, backend, n, opts, launcher, timeout: (impl, backend, n, opts))
    monkeypatch.setattr(tb, "digest", lambda rec: {"seen": rec})
    cases = ["spmd gloo", "spmd mpi", "DDP gloo"]
    rows = tb.measure(ranks=(2,), repeats=4, cases=cases)
    seen = [[r["case"] for r in rows if r["repeat"] == rep] for rep in range(4)]
    assert all(sorted(s) == sorted(cases) for s in seen), seen
    firsts = [s[0] for s in seen]
    assert firsts[:3] == [seen[0][0], seen[0][1], seen[0][2]] and firsts[3] == firsts[0], seen


@pytest.mark.unit
def test_digest_takes_the_slowest_rank_per_step_and_means_of_the_parts():
    # Two ranks, one warm-up step then two timed ones; seconds.
    def two(a, b):
        return [[9.0] + a, [9.0] + b]

    record = {"warmup": 1, "steps": 2, "ranks": 2, "losses": [3.4, 3.3, 3.2],
              "parts": {"step": two([0.100, 0.120], [0.110, 0.100]), "forward": two([0.02, 0.02], [0.02, 0.02]),
                        "backward": two([0.04, 0.05], [0.04, 0.05]), "sync": two([0.03, 0.03], [0.03, 0.01]),
                        "optimizer": two([0.005, 0.005], [0.005, 0.005]),
                        "local_forward": two([0.02, 0.02], [0.02, 0.02]),
                        "local_backward": two([0.04, 0.04], [0.04, 0.04])}}
    row = tb.digest(record)
    assert row["steps_ms"] == pytest.approx([110.0, 120.0]) and row["step_ms"] == pytest.approx(115.0)
    assert row["step_mean_ms"] == pytest.approx(107.5) and row["sync"] == pytest.approx(25.0)
    assert row["comm"] == pytest.approx(45.0 + 25.0 - 40.0)
    assert row["other"] == pytest.approx(107.5 - (20 + 45 + 25 + 5))
    assert row["loss0"] == 3.4


needs_mpirun = pytest.mark.skipif(MPIRUN is None, reason="mpirun not found: pip install mpich")


@pytest.mark.launcher
@needs_mpirun
@pytest.mark.timeout(600)
def test_tiny_run_has_every_case_positive_parts_and_the_same_start(tmp_path):
    out = tmp_path / "train.json"
    cmd = [PY, "-m", "spmd.bench.train", "--ranks", "1,2", "--repeats", "1", "--steps", "3", "--warmup", "1",
           "--dim", "32", "--layers", "1", "--global-batch", "8", "--loss-steps", "3", "--json", out]
    done = run(cmd, timeout=560, env=clean_env())
    assert done.returncode == 0, done.stdout[-4000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert {(r["case"], r["ranks"]) for r in rows} == {(c[0], n) for c in tb.CASES for n in (1, 2)}
    for r in rows:
        assert r["step_ms"] > 0 and r["forward"] > 0 and r["backward"] > 0 and r["optimizer"] > 0, r
        assert r["local_backward"] > 0 and r["sync"] >= 0 and len(r["steps_ms"]) == 3, r
        parts = r["forward"] + r["backward"] + r["sync"] + r["optimizer"]
        assert 0.7 * r["step_mean_ms"] <= parts <= r["step_mean_ms"] * 1.0001, r
        if r["impl"] == "ddp":
            assert r["sync"] == 0 and r["buckets"] is None
        else:
            # A world of one runs serial whatever SPMD_BACKEND says.
            assert r["backend"] == ("serial" if r["ranks"] == 1 else r["case"].split()[1]), r
    # Same parameters and data everywhere: the global batch's loss before any step agrees.
    loss0 = [r["loss0"] for r in rows]
    assert max(loss0) - min(loss0) < 1e-5, sorted((r["loss0"], r["case"], r["ranks"]) for r in rows)
    assert set(doc["losses"]) == {"fp32", "bf16"} and all(len(v["losses"]) == 3 for v in doc["losses"].values())
    assert doc["losses"]["fp32"]["losses"][0] == pytest.approx(loss0[0], abs=1e-5)
    assert "targets:" in done.stdout and "DDP gloo" in done.stdout


@pytest.mark.launcher
@pytest.mark.timeout(300)
def test_the_powersgd_case_runs_beside_ddp_from_the_same_start(tmp_path):
    # DDP's own powerSGD case is left out: torch's hook on gloo hung or aborted on a collective
    # mismatch in some launches here (docs/bench.md), which would make this test flaky.
    out = tmp_path / "train.json"
    cases = ["spmd gloo powersgd:4", "DDP gloo"]
    cmd = [PY, "-m", "spmd.bench.train", "--ranks", "2", "--repeats", "1", "--steps", "3", "--warmup", "1",
           "--dim", "32", "--layers", "1", "--global-batch", "8", "--loss-steps", "0", "--launcher", "spmd",
           "--cases", ",".join(cases), "--json", out]
    done = run(cmd, timeout=280, env=clean_env())
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == sorted(cases)
    low, ddp = rows["spmd gloo powersgd:4"], rows["DDP gloo"]
    assert low["sync"] > 0 and low["loss0"] == pytest.approx(ddp["loss0"], abs=1e-5)
    # Low-rank gradients train differently from the first step (measured after 4 steps:
    # 3.6212 against 3.6101 uncompressed, from 3.5389), but they train.
    assert low["loss_last"] != ddp["loss_last"] and abs(low["loss_last"] - ddp["loss_last"]) < 0.1


@pytest.mark.unit
def test_the_low_rank_wire_of_ddp_counts_what_dataparallel_sends():
    from spmd.bench.train_worker import load_job, powersgd_elements
    from spmd.train.data_parallel import DataParallel
    from tests.support import ranks_ok, run_ranks

    model = load_job().build_model(0, dim=32, layers=1, heads=4)
    # Rank 16: the positions (16 x 32) cost more as factors and go whole, the tokens (33 x 32) do not.
    (out, _) = ranks_ok(run_ranks(1, lambda comm: DataParallel(model, comm, compress="powersgd:16")))
    dp = out[0]
    assert [n for n in dp.powersgd.names if n.startswith(("tokens", "positions"))] == ["tokens.weight"]
    sent = dp.powersgd.wire_elements + sum(b.flat.numel() for b in dp.buckets)
    assert powersgd_elements(model, 16) == sent < sum(p.numel() for p in model.parameters())
