"""Where spmd's own files are, and the modules spmd starts with ``python -m``.

The one place that locates the package: which frames count as spmd's (not the
user's) in reports and call records, which sources a kept fork server watches.
"""

import os

__all__ = ["PACKAGE_DIR", "is_spmd_file", "RUNNER", "FORK_SERVER", "KEPT_SERVER", "BENCH",
           "PIPELINE_WORKER", "TRAIN_WORKER"]

#: The directory of the spmd package (its ``__init__.py`` lies there).
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: ``python -m RUNNER script.py``: every rank's entry point (spmd.runtime.runner).
RUNNER = "spmd"
#: The fork server of ``spmd run --preload`` and the one kept across launches.
FORK_SERVER = "spmd.launch.forkserver.forker"
KEPT_SERVER = "spmd.launch.forkserver.keptserver"
#: The benchmark's own launches.
BENCH = "spmd.cli.bench"
PIPELINE_WORKER = "spmd.bench.pipeline_worker"
TRAIN_WORKER = "spmd.bench.train_worker"


def is_spmd_file(filename: str) -> bool:
    """Whether filename (a code object's, say) is one of spmd's own sources."""
    return os.path.abspath(filename).startswith(PACKAGE_DIR + os.sep)
