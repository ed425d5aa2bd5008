"""A host fails while the ranks compute (tests/cluster/host_faults.py): its link cut, a silent partition,
every process frozen, every process killed.  The ranks on the host left end within the heartbeat's
detection and a few seconds, far under SPMD_TIMEOUT (60 s here): one report names the host and its ranks,
no process of the job stays on the host left, and the status is not 0.

SPMD_HEARTBEAT=1 keeps the tier short (silence after 5 s); docs/reliability.md ("Host faults") measures
the default (2 s, silence after 10 s).  The clock starts at the fault, struck by this process (the
lab's hosts share its monotonic clock), not at the launch.
"""

import re

import pytest

from tests.cluster.host_faults import FAULTS, strike
from spmd.failfast.hub.judge import MISSES

pytestmark = pytest.mark.cluster

BEAT = 1
#: Seconds from the fault to the last rank's end on h1: the silence (5 s) and room for a loaded machine.
BOUND = BEAT * MISSES + 8
#: Seconds a launcher may take to end after its ranks did, before the test ends it itself.
LAUNCHER_WAIT = 10
SILENT = re.compile(r"^### spmd: no word from h2 \(ranks 2, 3\) for \d+ s \(no heartbeat: .*; ending the job$", re.M)
DIED = re.compile(r"^### spmd: ranks? [23](, 3)? of 4 on h2 died without reporting an error .*; ending the job$", re.M)


def _strike(lab, launcher, backend, fault):
    ended = strike(lab, launcher, backend, fault, compute=25, launcher_wait=LAUNCHER_WAIT, SPMD_HEARTBEAT=str(BEAT))
    out = ended.output
    assert "COMPUTING" in out and "DONE" not in out, out[-4000:]  # no all_reduce ever completed
    assert ended.ranks_end is not None and ended.ranks_end < BOUND, (ended.ranks_end, out[-4000:])
    assert ended.left == [], (ended.left, out[-4000:])  # nothing of the job on h1, its launcher's agent included
    if not ended.killed_launcher:
        assert ended.statuses[0] != 0, out[-4000:]
    return ended, out


@pytest.mark.parametrize("fault", FAULTS)
def test_a_host_fault_under_torchrun_ends_the_ranks_left_and_names_the_host(lab, fault):
    """torchrun on h1 and h2, 2 ranks each, gloo: each fault ends h1's ranks and its agent (status 1) within
    the bound; rank 0's one report names h2 and both its ranks."""
    ended, out = _strike(lab, "torchrun", "gloo", fault)
    assert not ended.killed_launcher, out[-4000:]  # torchrun's agent on h1 ends by itself
    said = SILENT.findall(out) if fault != "kill" else DIED.findall(out)
    assert len(said) == 1, out[-4000:]
    assert "exitcode  : 75" in out  # the ranks ended by the hub, as torchrun shows them


@pytest.mark.parametrize("fault", FAULTS)
def test_a_host_fault_under_mpiexec_ends_the_ranks_left_and_names_the_host(lab, fault):
    """MPICH's mpiexec from the login host over h1 and h2, the mpi backend.  Silent faults: rank 0's report
    names h2 and its ranks.  Every process of h2 killed: Hydra sees its proxy's connection close and ends
    every rank at once (0.1 s), before the hub can speak: its words name no host, and spmd says nothing
    (or, if it is first, names h2).  After a cut or a freeze, Hydra's mpiexec on the login host goes on
    waiting for h2's proxy: the test ends it after LAUNCHER_WAIT s (docs/reliability.md measures how long
    it waited)."""
    ended, out = _strike(lab, "mpiexec", "mpi", fault)
    if fault == "kill":
        assert all(DIED.fullmatch(line) for line in re.findall(r"^### spmd: .*; ending.*$", out, re.M)), out[-4000:]
        assert ended.ranks_end < 5, ended.ranks_end
    else:
        assert len(SILENT.findall(out)) == 1, out[-4000:]
    if fault in ("drop", "kill"):  # Hydra still reaches h2's proxy, or saw it die
        assert not ended.killed_launcher, out[-4000:]
