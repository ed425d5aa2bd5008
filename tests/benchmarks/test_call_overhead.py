"""benchmarks.call_overhead: two trees interleaved, each worker on its own tree's spmd."""

import shutil
import subprocess
import sys

import pytest

from benchmarks import call_overhead
from tests.support import REPO


@pytest.mark.launcher
def test_a_small_comparison_of_a_tree_with_itself_fills_every_cell(tmp_path):
    other = tmp_path / "copy"
    shutil.copytree(REPO / "spmd", other / "spmd", ignore=shutil.ignore_patterns("__pycache__"))
    seen = []
    rows = call_overhead.compare(str(REPO), str(other), rounds=2, calls=20, ranks=1, progress=seen.append)
    assert len(rows) == len(call_overhead.BACKENDS) * len(call_overhead.FORMS) * len(call_overhead.SIZES)
    for backend, form, nbytes, before, after, ratios in rows:
        assert before > 0 and after > 0 and len(ratios) == 2, (backend, form, nbytes)
    # rotated: round 1 runs the first tree first on each backend, round 2 the second
    assert seen[:2] == [f"round 1: mpi {REPO} done", f"round 1: mpi {other} done"]
    assert seen[4:6] == [f"round 2: mpi {other} done", f"round 2: mpi {REPO} done"]


@pytest.mark.launcher
def test_a_worker_that_imports_another_trees_spmd_is_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()  # no spmd here: the workers would import the installed one
    done = subprocess.run([sys.executable, "-m", "benchmarks.call_overhead", str(REPO), str(empty), "--rounds", "1",
                           "--calls", "5"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and f"{empty}: the workers imported" in done.stderr, done.stderr[-2000:]
