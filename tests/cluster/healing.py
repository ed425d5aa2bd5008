"""What the healing tests share: the main job with --resume, its uninterrupted reference, and the checks.

The job (jobs/scatter_gather.py, 100 rounds: about 8 s at 3 ranks here, so a host killed once a tenth of
the rounds is journaled dies mid-job) and the reference it must end with: the checksum line and the
output's sha256 of an uninterrupted run at 2 ranks on h1 and h2 (MPICH's mpiexec), computed once per session.
"""

from __future__ import annotations

import hashlib
import os
import re

from spmd.pipeline.journal import journal_path
from tests.cluster.host_faults import job_processes
from tests.cluster.runs import PY, mpiexec
from tests.support import REPO

__all__ = ["ROWS", "CHUNK", "JOB", "TIMEOUT", "sha256", "checksum", "reference", "journaled", "no_job_left"]

ROWS, CHUNK = 1_500_000, 15_000
JOB = [REPO / "jobs" / "scatter_gather.py", "--rows", ROWS, "--chunk-rows", CHUNK, "--task", "mlp"]
TIMEOUT = 240

_reference: dict[str, tuple[str, str]] = {}


def sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def checksum(out):
    found = re.findall(r"^checksum crc32c \w+ \(input \w+\)$", out, re.M)
    assert len(found) == 1 and f"{ROWS} rows in, {ROWS} out" in out, out[-4000:]
    return found[0]


def reference(lab, where):
    """(checksum line, output's sha256) of the job uninterrupted at 2 ranks on h1 and h2: once per session."""
    if "pipeline" not in _reference:
        out = where / "reference.npy"
        done = mpiexec(lab, ["-n", "2", "-ppn", "1", PY, *JOB, "--output", out], ["h1", "h2"], TIMEOUT,
                       SPMD_BACKEND="gloo")
        assert done.returncode == 0, done.stdout[-4000:]
        _reference["pipeline"] = checksum(done.stdout), sha256(out)
        out.unlink()
    return _reference["pipeline"]


def journaled(out, fraction=10):
    """Whether the journal of the job writing out holds more than 1/fraction of its rounds."""
    journal = journal_path(out)
    return os.path.exists(journal) and len(open(journal).read().splitlines()) > ROWS // CHUNK // fraction


def no_job_left(lab, hosts, word):
    for host in hosts:
        left = job_processes(lab, host)  # whole command lines (ps -ww): a cut one could hide the word
        assert not [line for line in left if word in line or "torchrun" in line], (host, left)
