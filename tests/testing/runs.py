"""Running a user's test files with the plugin, as a user would: pytest in a subprocess, its junit file read."""

import shutil
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.support import PY, clean_env, finish, left_behind, start

SAMPLES = Path(__file__).parent / "samples"

#: How sample_user.py ends in a world of 4 ranks started by a launcher.
UNDER_A_WORLD_OF_4 = {
    "test_numpy_and_torch": "passed",
    "test_tmp_path_is_one_directory[2 ranks]": "passed",
    "test_tmp_path_is_one_directory[3 ranks]": "passed",
    "test_odd_ranks_fail": "failed",
    "test_capsys": "passed",
    "test_xfail": "skipped",
    "test_skip_inside": "skipped",
    "test_six": "skipped",  # 6 ranks in a world of 4
    "test_with_params[1]": "passed",
    "test_with_params[2]": "passed",
    "test_unmarked": "passed",
    "test_comm_without_marker": "error",
}


def user_dir(tmp_path, *samples):
    """A directory holding the samples as test files (sample_x.py -> test_x.py) and the user's conftest."""
    where = tmp_path / "user"
    where.mkdir()
    shutil.copy(SAMPLES / "conftest_sample.py", where / "conftest.py")
    for name in samples:
        shutil.copy(SAMPLES / f"sample_{name}.py", where / f"test_{name}.py")
    return where


def cases(junit):
    """{test name: (outcome, message, seconds)} from a junit file; outcome passed/failed/error/skipped."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, message = {"failure": "failed"}.get(child.tag, child.tag), child.get("message", "")
        out[case.get("name")] = (outcome, message, float(case.get("time", 0)))
    return out


def pytest_in(where, *args, launcher=(), python=(PY,), timeout=240, env=None):
    """Run pytest in where (under launcher, a command prefix, with python); return (result, cases, leftovers)."""
    mark = f"spmd-pytest-{uuid.uuid4().hex[:12]}"
    junit = where / "junit.xml"
    cmd = [*launcher, *python, "-m", "pytest", "-rA", "--strict-markers",
           f"--junitxml={junit}", *args]
    proc = start(cmd, env=clean_env(SPMD_PYTEST_SAMPLE_RUN=mark, **(env or {})), cwd=where)
    result = finish(proc, timeout, "pytest of the sample tests")
    found = cases(junit) if junit.exists() else {}
    return result, found, left_behind(mark)
