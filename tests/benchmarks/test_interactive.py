"""benchmarks.interactive: its table of medians and targets, and a small run beside ipyparallel."""

import pytest

from benchmarks import interactive as ib


@pytest.mark.unit
def test_the_report_takes_medians_and_says_which_targets_are_met():
    times = {case: {"spmd": [0.004, 0.003, 0.5], "ipyparallel": [0.02, 0.03, 0.01]} for case in ib.TARGETS}
    times["start of a world (restart, torch preloaded)"] = {"spmd": [2.5, 3.0, 2.2], "ipyparallel": [8.0, 9.0, 7.0]}
    times["start of a whole session"] = {"spmd": [4.0], "ipyparallel": [9.0]}
    lines = ib.report(times, 4).split("\n")
    assert lines[0] == "interactive, 4 ranks (medians; ipyparallel: 4 mpiexec engines)"
    row = next(ln for ln in lines if ln.startswith("x = 1"))
    assert row.split()[3:] == ["4.0", "ms", "20.0", "ms", "0.20x", "20.0", "ms", "met"]
    start = next(ln for ln in lines if ln.startswith("start of a world"))
    assert start.rstrip().endswith("MISSED") and "0.31x" in start
    whole = next(ln for ln in lines if ln.startswith("start of a whole session"))
    assert whole.split()[-1] == "0.44x"  # no target


@pytest.mark.launcher
@pytest.mark.timeout(400)
def test_a_small_run_measures_every_case_of_both_tools():
    pytest.importorskip("ipyparallel", reason="pip install -r benchmarks/requirements.txt")
    times = ib.measure(ranks=2, repeats=2, starts=1)  # raises if either all-reduce gave a wrong sum
    assert set(times) == {"x = 1", "all_reduce of 8 float64", "start of a world (restart, torch preloaded)",
                          "start of a whole session"}
    for case, by in times.items():
        assert len(by["spmd"]) == len(by["ipyparallel"]) == (2 if case in ("x = 1", "all_reduce of 8 float64") else 1)
        assert all(t > 0 for t in by["spmd"] + by["ipyparallel"]), (case, by)


@pytest.mark.launcher
@pytest.mark.timeout(400)
def test_cells_in_two_real_kernels_are_timed_for_both_tools_and_their_sums_checked():
    pytest.importorskip("ipyparallel", reason="pip install -r benchmarks/requirements.txt")
    pytest.importorskip("ipykernel", reason="the interactive extra: pip install 'spmd[interactive]'")
    from benchmarks.notebook import CELLS, measure_cells

    times = measure_cells(ranks=2, repeats=2)  # raises if a cell failed or either all-reduce gave a wrong sum
    assert set(times) == set(CELLS)
    for case, by in times.items():
        assert len(by["spmd"]) == len(by["ipyparallel"]) == 2, (case, by)
        assert all(t > 0 for t in by["spmd"] + by["ipyparallel"]), (case, by)
    assert ib.report(times, 2).count("\n") == len(CELLS) + 1
