"""benchmarks.formats: its medians and targets, and a small run of every tool on both formats."""

import pytest

from benchmarks import formats as fb
from spmd.errors import BenchError


def _row(fmt, case, seconds, crc="abcd0123", repeat=0):
    return {"format": fmt, "case": case, "seconds": seconds, "crc": crc, "repeat": repeat}


@pytest.mark.unit
def test_the_summary_takes_medians_checks_the_outputs_agree_and_the_targets_compare():
    rows = []
    for rep, jitter in enumerate((0.0, 0.3, -0.1)):
        for fmt in fb.FORMATS:
            rows += [_row(fmt, "spmd pipeline", 1.0 + jitter, repeat=rep), _row(fmt, "Dask, 2 threads", 2.0 + jitter),
                     _row(fmt, "mpi4py loop", 1.1 + jitter), _row(fmt, "one process", 1.8 + jitter)]
        rows.append({"format": "parquet", "case": "read", "spmd": 0.30 + jitter / 10, "read_table": 0.2,
                     "read_table_2d": 0.28})
    s = fb.summary(rows)
    assert s[("parquet", "spmd pipeline")] == 1.0 and s[("zarr", "Dask, 2 threads")] == 2.0
    got = {t: (ok, how) for t, ok, how in fb.targets(s)}
    assert got["parquet: spmd at most 0.8x Dask, 2 threads"] == (True, "1.000 s against 2.000 s: 0.50x")
    assert got["zarr: spmd at most 0.8x mpi4py loop"][0] is False  # 0.91x
    assert got["Parquet read at most 1.2x pyarrow's read_table"][0] is False  # 1.50x
    text = fb.report({"rows": rows, "table_rows": 1000, "chunk": 100, "repeats": 3})
    assert "NOT met  zarr: spmd at most 0.8x mpi4py loop: 1.000 s against 1.100 s: 0.91x" in text
    for r in rows:  # the read's CPU seconds, where recorded, beside its wall
        if r["case"] == "read":
            r.update(spmd_cpu=0.25, read_table_cpu=0.4)
    how = {t: h for t, _, h in fb.targets(fb.summary(rows))}["Parquet read at most 1.2x pyarrow's read_table"]
    assert how.endswith("; CPU 0.250 s against 0.400 s: 0.62x"), how
    rows.append(_row("zarr", "one process", 1.0, crc="ffff0000"))
    with pytest.raises(BenchError, match="different rows on zarr"):
        fb.summary(rows)


@pytest.mark.launcher
@pytest.mark.timeout(400)
def test_a_small_run_of_every_tool_writes_the_same_rows(tmp_path):
    pytest.importorskip("dask", reason="pip install -r benchmarks/requirements.txt")
    pytest.importorskip("pyarrow", reason="the formats extra: pip install 'spmd[formats]'")
    paths = fb.prepare(str(tmp_path), rows=30_000)
    rows = fb.measure(str(tmp_path), paths, repeats=1, chunk=7000)
    s = fb.summary(rows)  # raises unless every tool's output has the same checksum, per format
    assert {(r["format"], r["case"]) for r in rows if r["case"] != "read"} == {
        (fmt, label) for fmt in fb.FORMATS for label, impl, _ in fb.CASES if fmt in fb.ONLY.get(impl, fb.FORMATS)}
    assert ("zarr", "loop, spmd's choices") not in s and ("parquet", "loop, spmd's choices") in s
    assert all(r.get("rows", 30_000) == 30_000 for r in rows)
    ranks = {label: n for label, _, n in fb.CASES}  # every process's CPU seconds, for the tools' cores in use
    assert all(len(r["cpu"]) == ranks[r["case"]] and min(r["cpu"]) > 0 for r in rows if r["case"] != "read"), rows
    assert s[("zarr", "mpi4py loop", "cpu")] == pytest.approx(
        sorted(sum(r["cpu"]) for r in rows if (r["format"], r["case"]) == ("zarr", "mpi4py loop"))[0])
    assert all(v > 0 for v in s.values()) and len(fb.targets(s)) == 2 * len(fb.FORMATS) + 1
    assert "cpu s" in fb.report({"rows": rows, "table_rows": 30_000, "chunk": 7000, "repeats": 1})
    spmd_runs = [r for r in rows if r["case"] == "spmd pipeline"]
    assert all(r["read"] == "parallel" for r in spmd_runs), spmd_runs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.npy", "in.parquet", "in.zarr"]  # outputs removed
