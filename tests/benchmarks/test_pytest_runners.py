"""benchmarks.pytest_runners: the generated tests, the command lines, the scaling and the table.

Nothing is launched: the runs are replaced where a test needs them.
"""

import ast
import sys

import pytest
from click.testing import CliRunner

from benchmarks import pytest_runners as pb
from spmd.cli.bench import bench

PY = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
PATHS = {kind: f"/t/{name}" for kind, name in pb.FILES.items()}


def _tests(tree):
    """Names of the test functions and test methods in a module."""
    return [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]


@pytest.mark.unit
def test_each_tool_gets_the_same_tests_in_its_own_api():
    src = pb.sources(tests=7, ranks=3)
    assert set(src) == set(pb.FILES)
    for kind, text in src.items():
        tree = ast.parse(text)
        assert _tests(tree) == [f"test_{k}" for k in range(7)], kind
    assert src["spmd"].count("@pytest.mark.spmd(ranks=3)") == 7 and "RANKS = 3" in src["spmd"]
    assert src["pytest_parallel"].count("@pytest_parallel.mark.parallel(3)") == 7
    assert "import pytest_parallel" in src["pytest_parallel"] and "comm.Allreduce" in src["pytest_parallel"]
    assert src["mpi4py"].count("check(MPI.COMM_WORLD,") == 7 and "from mpi4py import MPI" in src["mpi4py"]
    assert "class Collectives(MultiProcessTestCase)" in src["torch"] and "return 3" in src["torch"]
    assert '"gloo"' in src["torch"] and "self._spawn_processes()" in src["torch"]
    for text in src.values():  # the same three collectives, checked, with each test's own number
        assert text.count("assert ") >= 3 and "10 * i + k" in text
    assert _tests(ast.parse(pb.sources(200, 4)["spmd"])) == [f"test_{k}" for k in range(200)]


@pytest.mark.unit
def test_the_sample_spreads_over_the_tests():
    assert pb.sample(200, 10) == list(range(0, 200, 20))
    assert pb.sample(10, 3) == [0, 3, 6]
    assert pb.sample(5, 10) == pb.sample(5, 5) == [0, 1, 2, 3, 4]


@pytest.mark.unit
def test_the_command_lines():
    got = pb.commands(PATHS, 4, [0, 5], "/m/mpirun", junit="/t/j.xml")
    assert list(got) == list(pb.WAYS)
    mpi = ["/m/mpirun", "-n", "4"]
    assert got["spmd"] == [[*PY, PATHS["spmd"]]]
    assert got["spmd-mpirun"] == [[*mpi, *PY, PATHS["spmd"]]]
    assert got["pytest_parallel"] == [[*mpi, *PY, "-p", "no:spmd", "-p", "no:timeout", "-p", "pytest_parallel.plugin",
                                       "--scheduler=static", PATHS["pytest_parallel"]]]
    assert got["mpirun-per-test"] == [[*mpi, *PY, "-p", "no:spmd", f"{PATHS['mpi4py']}::test_{k}"] for k in (0, 5)]
    assert got["torch"] == [[*PY, "-p", "no:spmd", "--junitxml", "/t/j.xml",
                             f"{PATHS['torch']}::Collectives::test_0", f"{PATHS['torch']}::Collectives::test_5"]]
    # pytest_parallel's entry point installed: the others leave it out, its own way loads it by the entry point
    both = pb.commands(PATHS, 2, [1], "/m/mpirun", block_parallel=True, parallel_entry=True)
    assert both["spmd"] == [[*PY, "-p", "no:parallel", PATHS["spmd"]]]
    assert both["mpirun-per-test"] == [["/m/mpirun", "-n", "2", *PY, "-p", "no:parallel", "-p", "no:spmd",
                                        f"{PATHS['mpi4py']}::test_1"]]
    assert both["pytest_parallel"][0][-4:] == ["-p", "no:timeout", "--scheduler=static", PATHS["pytest_parallel"]]
    assert both["torch"][0][len(PY):len(PY) + 4] == ["-p", "no:parallel", "-p", "no:spmd"]
    entry_only = pb.commands(PATHS, 2, [1], "/m/mpirun", parallel_entry=True)  # on --tools-path only
    assert entry_only["spmd"] == [[*PY, PATHS["spmd"]]] and "no:parallel" in entry_only["torch"][0]
    assert list(pb.commands(PATHS, 4, [0], None)) == ["spmd", "torch"]  # no mpirun


def _doc(times, tests=200, sampled=10, skipped=None):
    return {"tests": tests, "ranks": 4, "repeats": 3, "sampled": sampled, "times": times,
            "skipped": skipped or {}, "commands": {"spmd": "python -m pytest -q FILE"}, "started": "2026-12-02",
            "uptime": "up 1 min, load average: 0.10, 0.20, 0.30", "cpus": 2,
            "load_average_start": [0.1, 0.2, 0.3], "load_average_end": [1.0, 0.5, 0.4]}


@pytest.mark.unit
def test_the_table_gives_medians_spread_per_test_and_ratio():
    doc = _doc({"spmd": [10.0, 12.0, 11.0], "pytest_parallel": [22.0, 20.0, 21.0], "mpirun-per-test": [60.0] * 3})
    lines = pb.table(doc).splitlines()
    assert lines[0] == "| way | seconds for 200 tests | spread (min-max) | ms per test | time / plain pytest's |"
    assert lines[1] == "|---|---:|---:|---:|---:|"
    assert lines[2] == "| spmd plugin, `pytest` | 11.00 | 10.00-12.00 | 55.0 | 1.00 |"
    assert lines[3] == ("| pytest_parallel (static scheduler), `mpirun -n 4 pytest` | 21.00 | 20.00-22.00 | 105.0 "
                        "| 1.91 |")
    assert lines[4] == ("| one `mpirun -n 4 pytest FILE::test_k` per test (mpi4py), scaled from 10 | 60.00 "
                        "| 60.00-60.00 | 300.0 | 5.45 |")
    assert len(lines) == 5
    whole = pb.table(_doc({"spmd": [1.0], "torch": [3.0]}, tests=5, sampled=5))
    assert "scaled" not in whole and "| torch MultiProcessTestCase (gloo, spawn) | 3.00 |" in whole


@pytest.mark.unit
def test_the_targets_and_the_report():
    doc = _doc({"spmd": [11.0], "pytest_parallel": [10.0], "mpirun-per-test": [60.0]},
               skipped={"torch": "cannot import it"})
    got = pb.targets(doc)
    assert [(label, ok) for label, ok, _ in got] == [
        ("200 4-rank tests under plain pytest in under 20.0 s", True),
        ("plain pytest at least 5x faster than one mpirun per test", True),
        ("plain pytest no slower than pytest_parallel under mpirun", False)]
    assert got[1][2].startswith("5.45x") and got[2][2].startswith("0.91x")
    assert pb.targets(_doc({"spmd": [3.0]}, tests=20))[0][:2] == (
        "20 4-rank tests under plain pytest in under 2.0 s (20 s for 200: 2.0 s for 20)", False)
    assert pb.targets(_doc({"torch": [3.0]})) == []
    text = pb.report(doc)
    assert "uptime: up 1 min, load average: 0.10, 0.20, 0.30" in text and "2026-12-02" in text
    assert "load average: start 0.10 0.20 0.30, end 1.00 0.50 0.40" in text
    assert "NOT met  plain pytest no slower than pytest_parallel" in text
    assert "left out:\n  torch: cannot import it" in text and "scaled rows time 10 tests" in text


@pytest.mark.unit
def test_sampled_ways_scale_to_all_the_tests(monkeypatch):
    monkeypatch.setattr(pb, "_run", lambda argv, env, cwd, timeout: 2.0)
    monkeypatch.setattr(pb, "_junit_times", lambda path: [1.0, 3.0])
    assert pb._time_way("mpirun-per-test", [["a"], ["b"]], {}, ".", 200, [0, 100], "j", 9) == 400.0  # 4 s for 2 tests
    assert pb._time_way("torch", [["a"]], {}, ".", 200, [0, 100], "j", 9) == 2.0 + 198 * 2.0
    assert pb._time_way("torch", [["a"]], {}, ".", 2, [0, 1], "j", 9) == 2.0
    assert pb._time_way("spmd", [["a"]], {}, ".", 200, [0, 100], "j", 9) == 2.0


@pytest.mark.unit
def test_the_ways_interleave_and_a_missing_tool_is_left_out(monkeypatch):
    order = []
    monkeypatch.setattr(pb, "_parallel_entry", lambda env: False)
    monkeypatch.setattr(pb, "_missing", lambda module, env: "No module named 'x'" if "parallel" in module else None)

    def timed(way, argvs, env, cwd, tests, picked, junit, timeout):
        order.append(way)
        if way == "torch":
            raise pb.BenchError("it broke")
        return 1.0

    monkeypatch.setattr(pb, "_time_way", timed)
    times, skipped, shown = pb.measure(tests=3, ranks=2, repeats=3, per_test=2, mpirun="/m/mpirun")
    assert order[:4] == ["spmd", "spmd-mpirun", "mpirun-per-test", "torch"]
    assert order[4:7] == ["spmd-mpirun", "mpirun-per-test", "spmd"]  # torch left out after it failed
    assert order[7:] == ["mpirun-per-test", "spmd", "spmd-mpirun"]
    assert set(times) == {"spmd", "spmd-mpirun", "mpirun-per-test"} and times["spmd"] == [1.0] * 3
    assert skipped["pytest_parallel"].startswith("cannot import pytest_parallel.plugin (No module named 'x')")
    assert "--tools-path" in skipped["pytest_parallel"] and skipped["torch"] == "failed: it broke"
    assert shown["spmd"].endswith("-m pytest -q -p no:cacheprovider test_spmd_plugin.py")


@pytest.mark.unit
def test_a_failing_spmd_way_ends_the_benchmark(monkeypatch):
    monkeypatch.setattr(pb, "_parallel_entry", lambda env: False)
    monkeypatch.setattr(pb, "_missing", lambda module, env: None)

    def timed(way, *args):
        raise pb.BenchError("spmd broke")

    monkeypatch.setattr(pb, "_time_way", timed)
    with pytest.raises(pb.BenchError, match="spmd broke"):
        pb.measure(tests=2, ranks=2, repeats=1, ways=("spmd",), mpirun="/m/mpirun")


@pytest.mark.unit
def test_its_command_line(monkeypatch, capsys):
    seen = {}

    def fake(tests, ranks, repeats, per_test, ways, tools_path, progress):
        seen.update(tests=tests, ranks=ranks, repeats=repeats, per_test=per_test, ways=ways, tools_path=tools_path)
        return _doc({"spmd": [1.0]}, tests=tests)

    monkeypatch.setattr(pb, "bench", fake)
    pb.main(["--tests", "20", "--ranks", "2", "--per-test-sample", "5", "--tools-path", "/x", "--quiet"])
    assert seen == {"tests": 20, "ranks": 2, "repeats": 3, "per_test": 5, "ways": list(pb.WAYS), "tools_path": "/x"}
    assert "| spmd plugin, `pytest` | 1.00 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        pb.main(["--ways", "spmd,nose"])
    assert "--ways: choose from" in capsys.readouterr().err
    flat = CliRunner().invoke(bench, ["--pytest"])  # spmd bench's flat form names where this benchmark is
    assert flat.exit_code == 2 and "python -m benchmarks.pytest_runners" in flat.output
