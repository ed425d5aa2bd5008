"""spmd bench: its subcommands, and they run at 2 ranks on tiny sizes with sane numbers.

No timing is asserted: only that every collective and implementation is
there, times are positive and ordered, and the bandwidths follow
nccl-tests' formulas.
"""

import importlib.util
import json
import sys

import pytest
from click.testing import CliRunner

from tests.support import MPIRUN, PY, clean_env, run
from spmd.bench import BUSBW, COLLECTIVES, EXTRAS, default_sizes, format_size, layout, parse_size
from spmd.bench.report import SCHEMA, summary, summary_table, table
from spmd.bench.startup import startup_table
from spmd.cli.bench import bench

needs_mpirun = pytest.mark.skipif(MPIRUN is None, reason="mpirun not found: pip install mpich")
IMPLS = {"spmd-mpi", "mpi4py", "spmd-gloo", "gloo"}
TINY = ["--sizes", "8,1K,64K", "--rounds", "2", "--target-time", "0.005", "--many", "10x256"]


# -- pure parts ------------------------------------------------------------------


@pytest.mark.unit
def test_sizes_parse_and_sweep():
    assert parse_size("8") == 8 and parse_size("4K") == 4096 and parse_size("1MiB") == 1 << 20
    assert parse_size("256M") == 256 << 20
    with pytest.raises(ValueError):
        parse_size("1.5M")
    sweep = default_sizes()
    assert sweep[0] == 8 and sweep[-1] == 256 << 20 and 1024 in sweep and 1 << 20 in sweep
    assert list(sweep) == sorted(set(sweep))
    assert default_sizes(8, 100, 4) == (8, 16, 64, 100)
    assert format_size(1 << 20) == "1 MiB" and format_size(24) == "24 B"


@pytest.mark.unit
@pytest.mark.parametrize("n", [2, 3, 8])
def test_busbw_factors_are_nccl_tests(n):
    assert BUSBW("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert BUSBW("all_reduce_many", n) == pytest.approx(2 * (n - 1) / n)
    for c in ("all_gather", "scatter", "gather", "scatter_uneven", "gather_uneven"):
        assert BUSBW(c, n) == pytest.approx((n - 1) / n)
    assert BUSBW("broadcast", n) == BUSBW("reduce", n) == 1.0


@pytest.mark.unit
def test_layouts_keep_the_bytes():
    assert layout("all_reduce", 8, 2).nbytes == 8
    assert layout("scatter", 1 << 20, 4).lengths == ((1 << 18) // 4,) * 4
    uneven = layout("gather_uneven", 1 << 20, 4)
    assert [m // uneven.lengths[0] for m in uneven.lengths] == [1, 2, 3, 4]
    assert 0.99 < uneven.nbytes / (1 << 20) <= 1
    assert layout("scatter_uneven", 8, 4) is None  # too small to be uneven
    many = layout("all_reduce_many", 0, 2, (200, 4096))
    assert (many.count, many.elems, many.nbytes) == (200, 1024, 200 * 4096)


def _row(c, impl, size, us):
    return {"collective": c, "impl": impl, "size": size, "bytes": size, "ranks": 2, "time_us": us,
            "p10_us": us * 0.9, "p90_us": us * 1.2, "algbw_gbps": size / us / 1e3,
            "busbw_gbps": size / us / 1e3 * BUSBW(c, 2), "calls_per_sample": 1, "samples": 4}


@pytest.mark.unit
def test_summary_and_table_from_rows():
    rows = []
    for size, us in ((8, 2.0), (1 << 20, 400.0)):
        rows += [_row("all_reduce", "spmd-mpi", size, us * 1.5), _row("all_reduce", "mpi4py", size, us),
                 _row("all_reduce", "spmd-gloo", size, us * 11), _row("all_reduce", "gloo", size, us * 10)]
    rows += [_row("all_reduce_many", "spmd-mpi", 800, 900.0), _row("all_reduce_many", "spmd-mpi+coalesce", 800, 90.0)]
    s = summary(rows)
    mpi = [x for x in s["wrapper"] if x["spmd"] == "spmd-mpi" and x["collective"] == "all_reduce"]
    assert {x["band"] for x in mpi} == {"< 1 KiB", ">= 1 MiB"}
    assert all(x["max_ratio"] == pytest.approx(1.5) for x in mpi)
    assert [x["median_added_us"] for x in mpi] == pytest.approx([1.0, 200.0])
    best = [x for x in s["best"] if x["collective"] == "all_reduce"]
    assert all(x["max_ratio"] == pytest.approx(1.5) for x in best)
    assert s["coalesce"][0]["speedup"] == pytest.approx(10.0)
    text = table(rows) + summary_table(s)
    assert "== all_reduce" in text and "1 MiB" in text and "speedup 10.0x" in text


@pytest.mark.unit
def test_plot_without_matplotlib_says_how_to_fix(monkeypatch, tmp_path):
    from spmd.bench.report import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        plot([_row("all_reduce", "gloo", 8, 1.0)], tmp_path / "x.png")


@pytest.mark.unit
def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from spmd.bench.report import plot

    rows = [_row(c, i, s, 10.0) for c in COLLECTIVES for i in IMPLS for s in (8, 1024)]
    plot(rows, tmp_path / "x.png", "test")
    assert (tmp_path / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.unit
def test_raw_coalescing_groups_by_dtype_and_copies_back():
    import numpy as np
    import torch

    from spmd.bench.builders import coalesced as _coalesced

    calls = []

    def doubling(x):  # stands in for an all_reduce of two ranks holding the same values
        calls.append((type(x).__name__, str(x.dtype), tuple(x.shape)))
        x *= 2

    xs = [torch.ones(3), torch.full((2, 2), 3.0, dtype=torch.float64), torch.ones(5),
          np.arange(4, dtype=np.int32), torch.ones(4)[::2]]
    _coalesced(doubling, xs)
    assert len(calls) == 3  # float32 tensors, float64 tensors, int32 arrays
    assert xs[0].tolist() == [2.0] * 3 and xs[1].tolist() == [[6.0, 6.0]] * 2
    assert xs[3].tolist() == [0, 2, 4, 6] and xs[4].tolist() == [2.0, 2.0]


@pytest.mark.unit
def test_import_is_light():
    code = "import sys, spmd.bench, spmd.cli.bench; print('torch' in sys.modules, 'mpi4py' in sys.modules)"
    result = run([PY, "-c", code], 60)
    assert result.stdout.split() == ["False", "False"], result.stdout


@pytest.mark.unit
def test_bench_alone_explains_how_to_start_it():
    result = CliRunner().invoke(bench, ["collectives", "--sizes", "8"], env=clean_env())
    assert result.exit_code != 0
    assert "at least 2 ranks" in result.output and "collectives --launch 2" in result.output


@pytest.mark.unit
def test_bad_collective_is_a_usage_error():
    result = CliRunner().invoke(bench, ["collectives", "--collectives", "allreduce"], env=clean_env())
    assert result.exit_code == 2 and "all_reduce" in result.output


@pytest.mark.unit
def test_every_measurement_is_a_subcommand_with_its_own_options_only():
    result = CliRunner().invoke(bench, ["--help"])
    assert result.exit_code == 0
    for name in ("collectives", "memory", "startup", "preload", "pipeline", "train"):
        assert f"  {name} " in result.output, result.output
    result = CliRunner().invoke(bench, ["train", "--scenarios", "busy"])  # the pipeline's option
    assert result.exit_code == 2 and "--scenarios" in result.output and "No such option" in result.output
    result = CliRunner().invoke(bench, ["startup", "--sizes", "8"])  # the collectives' option
    assert result.exit_code == 2 and "--sizes" in result.output and "No such option" in result.output


@pytest.mark.unit
@pytest.mark.parametrize("old, new", [(["--startup", "--startup-ranks", "8"], "'spmd bench startup'"),
                                      (["--train", "--pipeline"], "'spmd bench train'"),
                                      (["--pytest"], "python -m benchmarks.pytest_runners"),
                                      (["--sizes", "8"], "'spmd bench collectives --sizes 8'")])
def test_the_old_flat_form_is_a_usage_error_that_names_the_new_one(old, new):
    result = CliRunner().invoke(bench, old)
    assert result.exit_code == 2 and new in result.output, result.output


@pytest.mark.unit
def test_train_takes_its_rank_counts_and_repeats(monkeypatch):
    from spmd.bench import train

    seen = {}
    monkeypatch.setattr(train, "bench", lambda ranks, repeats, model=None, progress=None:
                        seen.update(r=ranks, n=repeats, m=model) or {})
    monkeypatch.setattr(train, "report", lambda doc: "REPORT")
    result = CliRunner().invoke(bench, ["train", "--quiet"], env=clean_env())
    assert result.exit_code == 0 and "REPORT" in result.output and seen == {"r": (1, 2, 4), "n": 5, "m": None}, \
        result.output
    result = CliRunner().invoke(bench, ["train", "--ranks", "2", "--repeats", "3", "--vocab", "30522"],
                                env=clean_env())
    assert result.exit_code == 0 and seen == {"r": (2,), "n": 3, "m": {"vocab": 30522}}, result.output
    result = CliRunner().invoke(bench, ["train", "--ranks", "1.5"], env=clean_env())
    assert result.exit_code == 2 and "positive whole numbers" in result.output


@pytest.mark.unit
def test_launch_runs_the_same_subcommand_with_the_options_given(monkeypatch):
    from spmd.bench import startup
    from spmd.cli.bench import options

    calls = []
    monkeypatch.setattr(startup, "find_mpirun", lambda: "/m/mpirun")
    monkeypatch.setattr(options.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    result = CliRunner().invoke(bench, ["memory", "--launch", "2", "--size", "24M", "--backends", "gloo"])
    assert result.exit_code == 0, result.output
    assert calls == [["/m/mpirun", "-n", "2", sys.executable, "-m", "spmd.cli.bench", "memory",
                      "--backends", "gloo", "--size", "24M"]]
    result = CliRunner().invoke(bench, ["collectives", "--launch", "3", "--no-verify", "--spread"])
    assert result.exit_code == 0 and calls[-1][2:3] == ["3"] and calls[-1][6:] == ["collectives", "--spread",
                                                                                    "--no-verify"], calls[-1]


# -- real runs -------------------------------------------------------------------


def _check_rows(doc, collectives, ranks=2):
    assert doc["schema"] == SCHEMA
    assert doc["meta"]["ranks"] == ranks and "barrier" in doc["method"]
    rows = doc["rows"]
    assert {r["collective"] for r in rows} == set(collectives)
    for c in collectives:
        got = {r["impl"] for r in rows if r["collective"] == c}
        want = set(IMPLS)
        if c.endswith("_uneven"):
            want -= {"gloo"}  # torch.distributed has no uneven scatter or gather
        if c == "all_reduce_many":
            want |= {i + "+coalesce" for i in want}
        if c in ("scatter", "gather", "all_gather", "all_to_all"):  # spmd's equal=True, out= form too
            want |= {i + "+equal" for i in want if i.startswith("spmd-")}
        if c in ("pingpong", "sendrecv"):  # mpi4py's pickled send/recv, which carries dtype and shape
            want |= {"mpi4py+pickle"}
        assert got == want, (c, got)
    for r in rows:
        assert r["ranks"] == ranks and r["bytes"] > 0 and r["samples"] >= 2 and r["calls_per_sample"] >= 1
        assert 0 < r["p10_us"] <= r["time_us"] <= r["p90_us"], r
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3, rel=1e-9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * BUSBW(r["collective"], ranks), rel=1e-9)
    s = doc["summary"]
    assert set(s) == {"wrapper", "best", "uneven", "coalesce"}
    if "all_reduce_many" in collectives:
        assert {x["impl"] for x in s["coalesce"]} == {"spmd-mpi", "mpi4py", "spmd-gloo", "gloo"}
    return rows


@pytest.mark.launcher
@needs_mpirun
@pytest.mark.timeout(300)
def test_bench_at_two_ranks_under_mpirun(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [MPIRUN, "-n", 2, PY, "-m", "spmd.cli.bench", "collectives", *TINY, "--json", out]
    result = run(cmd, 280, clean_env())
    assert result.returncode == 0, result.stdout[-4000:]
    rows = _check_rows(json.loads(out.read_text()), COLLECTIVES + EXTRAS)
    assert {r["size"] for r in rows if r["collective"] == "all_reduce"} == {8, 1024, 65536}
    assert "== all_reduce  (2 ranks" in result.stdout and "spmd-mpi / mpi4py" in result.stdout


@pytest.mark.launcher
@needs_mpirun
@pytest.mark.timeout(200)
def test_point_to_point_and_the_later_collectives_are_verified_then_timed(tmp_path):
    out = tmp_path / "p2p.json"
    messages = ("pingpong", "sendrecv", "all_to_all", "reduce_scatter")
    args = ["--collectives", ",".join(messages), "--sizes", "8,4K", "--rounds", 1, "--target-time", "0.002",
            "--json", out]
    result = run([MPIRUN, "-n", 2, PY, "-m", "spmd.cli.bench", "collectives", *args], 180, clean_env())
    assert result.returncode == 0, result.stdout[-4000:]  # --verify (the default) checked every result first
    rows = _check_rows(json.loads(out.read_text()), messages)
    impls = {(r["collective"], r["impl"]) for r in rows}
    for m in messages:
        assert {(m, "spmd-mpi"), (m, "mpi4py"), (m, "spmd-gloo"), (m, "gloo")} <= impls, m
    assert ("all_to_all", "spmd-mpi+equal") in impls
    assert "== pingpong  (2 ranks" in result.stdout


@pytest.mark.launcher
@needs_mpirun
@pytest.mark.timeout(200)
def test_launch_option_starts_mpirun_itself(tmp_path):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    args = ["--launch", 2, "--collectives", "all_reduce,all_reduce_many", "--sizes", "8",
            "--rounds", 1, "--target-time", "0.002", "--many", "4x64", "--no-verify", "--json", out]
    if importlib.util.find_spec("matplotlib"):
        args += ["--plot", png]
    else:
        png = None
    result = run([PY, "-m", "spmd.cli.bench", "collectives", *args], 180, clean_env())
    assert result.returncode == 0, result.stdout[-4000:]
    _check_rows(json.loads(out.read_text()), ("all_reduce", "all_reduce_many"))
    assert png is None or png.stat().st_size > 1000


@pytest.mark.launcher
@needs_mpirun
@pytest.mark.timeout(200)
def test_chunked_all_reduce_memory_is_bounded_by_the_chunk(tmp_path):
    out = tmp_path / "mem.json"
    # 24 MiB: below the size from which the mpi backend works in pieces by itself.
    cmd = [MPIRUN, "-n", 2, PY, "-m", "spmd.cli.bench", "memory", "--size", "24M", "--chunk", "1M", "--json", out]
    result = run(cmd, 180, clean_env())
    assert result.returncode == 0, result.stdout[-4000:]
    rows = {(r["backend"], r["chunk_bytes"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("mpi", None), ("mpi", 1 << 20), ("gloo", None), ("gloo", 1 << 20)}
    assert all(r["correct"] for r in rows.values())
    # MPICH's allreduce takes half the array as scratch; in 1 MiB pieces it needs a few MiB at most.
    assert rows[("mpi", None)]["extra_kib"] > 8 * 1024, rows
    assert rows[("mpi", 1 << 20)]["extra_kib"] < 4 * 1024, rows
    assert rows[("gloo", 1 << 20)]["extra_kib"] < 4 * 1024, rows
    assert "extra / chunk" in result.stdout


@pytest.mark.launcher
@needs_mpirun
@pytest.mark.timeout(300)
def test_startup_breakdown(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import torch\nfrom spmd import comm\ncomm.barrier()\n")
    out = tmp_path / "s.json"
    cmd = [PY, "-m", "spmd.cli.bench", "startup", "--ranks", 2, "--repeats", 1, "--script", script, "--json", out,
           "--quiet"]
    result = run(cmd, 280, clean_env())
    assert result.returncode == 0, result.stdout[-4000:]
    rows = json.loads(out.read_text())["startup"]
    names = [r["scenario"] for r in rows]
    assert names[0] == "python -c pass" and names[-1] == "job.py: first collective"
    for r in rows:
        assert 0 < r["ready_s"] <= r["wall_s"] and r["cpu_s"] > 0, r
    numpy_only = next(r for r in rows if r["scenario"].startswith("spmd numpy"))
    assert numpy_only["torch_imported"] is False
    assert "issue: <= 2x" in startup_table(rows) and "issue: <= 2x" in result.stdout


# -- spmd bench pipeline ----------------------------------------------------------------


@pytest.mark.unit
def test_pipeline_summary_takes_medians_and_ratios_against_the_peers():
    from spmd.bench import pipeline as pb

    def rec(case, impl, ranks, seconds):
        return {"case": case, "impl": impl, "ranks": ranks, "seconds": seconds, "checksum": "ab",
                "peak_extra_kib": 1024, "rows_per_rank": [1]}

    rows = [rec("one process, one thread", "serial", 1, s) for s in (1.0, 3.0, 2.0)]
    rows += [rec("spmd (auto: parallel read)", "spmd", 2, s) for s in (0.5, 0.4, 9.0)]
    rows += [rec("mpi4py Scatterv/Gatherv loop", "mpi4py", 2, s) for s in (1.0, 1.0, 1.0)]
    rows += [rec("multiprocessing Pool.imap", "pool", 2, s) for s in (0.8, 0.8, 0.8)]
    s = pb.summary(rows)
    spmd = s[("spmd (auto: parallel read)", 2)]
    assert spmd["seconds"] == 0.5 and spmd["speedup"] == 4.0 and spmd["runs"] == 3
    assert spmd["vs_mpi4py"] == 0.5 and spmd["vs_pool"] == 0.625 and spmd["checksums"] == ["ab"]
    text = pb.table(rows)
    assert "0.500 (4.00x)" in text and "0.50 / 0.62" in text and "checksum: ab" in text


@pytest.mark.launcher
@needs_mpirun
@pytest.mark.timeout(400)
def test_pipeline_bench_runs_every_case_and_every_output_agrees(tmp_path):
    out = tmp_path / "pipeline.json"
    cmd = [PY, "-m", "spmd.cli.bench", "pipeline", "--ranks", "2", "--repeats", 1, "--rows", 40000,
           "--scenarios", "table,busy,memory", "--memory-rows", "40000", "--json", out, "--quiet"]
    result = run(cmd, 380, clean_env())
    assert result.returncode == 0, result.stdout[-4000:]
    doc = json.loads(out.read_text())
    cases = {(r["case"], r["ranks"]) for r in doc["table"]}
    assert len(cases) == 8 and ("one process, one thread", 1) in cases, cases
    assert len({r["checksum"] for r in doc["table"] + doc["busy"] + doc["memory"]}) == 1
    assert all(r["seconds"] > 0 and r["peak_extra_kib"] >= 0 for r in doc["table"])
    spmd = [r for r in doc["table"] if r["impl"] == "spmd"]
    assert {r["read"] for r in spmd} == {"parallel", "root"} and all(sum(r["rows_per_rank"]) == 40000 for r in spmd)
    assert {r["balance"] for r in doc["busy"]} == {"even", "speed"}
    assert "speed is" in result.stdout and "one round's input plus output" in result.stdout


@pytest.mark.launcher
@needs_mpirun
@pytest.mark.timeout(300)
def test_preload_bench_reports_every_scenario_and_the_targets(tmp_path):
    out = tmp_path / "preload.json"
    cmd = [PY, "-m", "spmd.cli.bench", "preload", "torch", "--ranks", 2, "--repeats", 1, "--json", out, "--quiet"]
    result = run(cmd, 280, clean_env())
    assert result.returncode == 0, result.stdout[-4000:]
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"empty", "preload", "kept", "spawn", "mpirun"}, doc
    for name, row in doc["results"].items():
        assert all(w > 0 for w in row["wall"]), (name, row)
        assert name == "empty" or all(0 < f <= w for f, w in zip(row["first"], row["wall"])), (name, row)
    assert "(target <= 2)" in result.stdout and "(target <= 0.5)" in result.stdout
    assert "kept's first collective / empty script's wall" in result.stdout, result.stdout[-4000:]
