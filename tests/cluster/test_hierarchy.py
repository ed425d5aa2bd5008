"""All_reduce by host across the private cluster's hosts: 2 hosts x 2 ranks, one launch per backend.

tests/worlds/hierarchy.py checks, in the launch, the hierarchy's results against the flat path's
(bit for bit for integers, within rounding for floats; numpy and torch; async; a list; chunk_bytes)
and, on gloo, that a 32 MiB all_reduce sends at most 0.75x raw torch.distributed's bytes out of
each host's link (read from eth0's counter inside each host's namespace); and the large broadcasts
(a chain) and all_gathers (a ring) of spmd.comms.pipelined against the data every rank made.
"""

import json
import re

import pytest

from tests.cluster.runs import PY, mpiexec
from tests.support import REPO

pytestmark = pytest.mark.cluster

WORLD = REPO / "tests" / "worlds" / "hierarchy.py"


def test_gloo_reduces_within_each_host_first_and_sends_fewer_bytes_across(lab):
    """By default (SPMD_HIERARCHY unset) on gloo across hosts: the flat path's results, fewer bytes out of h1."""
    out = mpiexec(lab, ["-n", "4", "-ppn", "2", PY, WORLD, "--bytes"], ["h1", "h2"], timeout=90,
                  SPMD_BACKEND="gloo")
    assert out.returncode == 0, out.stdout[-4000:]
    assert "HIERARCHY OK" in out.stdout, out.stdout[-4000:]
    said = json.loads(re.search(r"^BYTES (.*)$", out.stdout, re.M).group(1))
    assert said["hier"] <= 0.75 * said["raw"], said


def test_mpi_takes_it_when_asked(lab):
    """SPMD_HIERARCHY=on and SPMD_PIPELINED=on on the mpi backend (auto leaves MPI's own): the flat path's
    results, the plain broadcast's and all_gather's."""
    out = mpiexec(lab, ["-n", "4", "-ppn", "2", PY, WORLD], ["h1", "h2"], timeout=90,
                  SPMD_BACKEND="mpi", SPMD_HIERARCHY="on", SPMD_PIPELINED="on")
    assert out.returncode == 0, out.stdout[-4000:]
    assert "HIERARCHY OK" in out.stdout, out.stdout[-4000:]
