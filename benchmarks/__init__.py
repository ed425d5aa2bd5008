"""spmd beside the tools a user would pick instead: comparisons that live in the repository, not the package.

Run each from the repository's root (``python -m benchmarks.formats``, ...);
the tools they compare against are in benchmarks/requirements.txt
(``pip install -r benchmarks/requirements.txt``; bin/setup installs them).
What a user runs to measure their own cluster is ``spmd bench`` (spmd.bench).
docs/bench.md describes each benchmark's method.
"""

import os
from pathlib import Path

from spmd.bench.startup import clean_env

__all__ = ["ROOT", "launch_env"]

#: The repository's root, which holds this folder.
ROOT = Path(__file__).resolve().parents[1]


def launch_env(extra):
    """clean_env(extra) with the repository's root first on PYTHONPATH: a launch finds benchmarks from any folder."""
    env = clean_env(extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env
