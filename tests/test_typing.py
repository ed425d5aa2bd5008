"""The public API is typed: mypy in strict mode over a user's script and over spmd's public modules.

A user's editor and type checker learn spmd's API from its annotations
(spmd ships ``py.typed``).  mypy's cache lives outside the checkout
(``$XDG_CACHE_HOME/spmd/mypy``), so only the first run on a machine pays for
reading torch's and numpy's annotations.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
USER_SCRIPT = REPO / "tests" / "typecheck" / "api_user.py"

#: The modules of the public paths (spmd, spmd.pipeline, spmd.tasks, spmd.data_parallel,
#: spmd.checkpoint, spmd.preempt, Handle, DataParallel), checked whole in strict mode.
#: Comm's module (which holds the call path too), the modules of its method families and
#: the pipeline are checked through the user's script, which calls every public signature
#: they define.
PUBLIC = [
    "spmd/__init__.py",
    "spmd/errors.py",
    "spmd/tasks.py",
    "spmd/data_parallel.py",
    "spmd/checkpoint.py",
    "spmd/preempt.py",
    "spmd/pipeline/__init__.py",
    "spmd/runtime/proxy.py",
    "spmd/runtime/preempt.py",
    "spmd/comms/types.py",
    "spmd/comms/handle.py",
    "spmd/train/data_parallel.py",
    "spmd/train/checkpoint.py",
    "spmd/pipeline/sources.py",
    "spmd/pipeline/tasks.py",
]


def mypy(*paths):
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spmd" / "mypy"
    cmd = [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(cache), "--no-error-summary",
           "--config-file", str(REPO / "setup.cfg"), *map(str, paths)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_the_package_says_it_is_typed():
    assert (REPO / "spmd" / "py.typed").exists()


def test_a_users_script_and_the_public_modules_pass_strict_mypy():
    pytest.importorskip("mypy", reason="mypy is in spmd[test]: bin/setup installs it")
    out = mypy(USER_SCRIPT, *(REPO / p for p in PUBLIC))
    assert out.returncode == 0, f"mypy --strict found:\n{out.stdout}{out.stderr}"


def test_the_check_catches_a_wrong_use(tmp_path):
    pytest.importorskip("mypy", reason="mypy is in spmd[test]: bin/setup installs it")
    bad = tmp_path / "bad.py"
    bad.write_text("from spmd import comm\n\nrank: str = comm.rank\ncomm.broadcast([1, 2], root='zero')\n")
    out = mypy(bad)
    assert out.returncode == 1 and "bad.py:3" in out.stdout and "bad.py:4" in out.stdout, out.stdout
