"""A host fails (tests/cluster/host_faults.py): its link cut, a silent partition, every process frozen,
every process killed.  While the ranks compute, under torchrun, MPICH's mpiexec, srun (gloo and mpi) and
Open MPI's mpirun; inside a loop of collectives; during init; and the host of rank 0.  The ranks on the
host left end within the heartbeat's detection and a few seconds, far under SPMD_TIMEOUT (60 s here; at
init, before any heartbeat, within SPMD_TIMEOUT + 10 s, SPMD_TIMEOUT being 6 s there): one report names
the host and its ranks (at init: the ranks that never came), no process of the job stays on the host left,
and the status is not 0 (but Open MPI's, below).

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
#: ... for a launcher on the login host (mpiexec, mpirun, srun), which goes on waiting for a host cut off,
#: frozen or (srun) killed: those that end do so within a second of the ranks (docs/reliability.md).
SHORT_WAIT = 4
SILENT = re.compile(r"^### spmd: no word from h2 \(ranks 2, 3\) for \d+ s \(no heartbeat: .*; ending the job$", re.M)
DIED = re.compile(r"^### spmd: ranks? [23](, 3)? of 4 on h2 died without reporting an error .*; ending the job$", re.M)
#: What each rank left says when rank 0's host falls silent, or dies.
NO_RANK_0 = re.compile(r"^### spmd: rank ([23]): no word from h1 \(rank 0\) for \d+ s \(no heartbeat: .*; ending$",
                       re.M)
LOST_RANK_0 = re.compile(r"^### spmd: rank ([23]): lost rank 0 on h1 \(it died, or its host did\); ending$", re.M)
#: init's timeout there, and its report: rank 0's, once, naming the ranks that never came.
INIT_TIMEOUT = 6
MISSING = re.compile(r"^### spmd: init failed on every rank \(RendezvousError\):\nonly 2 of 4 ranks arrived within "
                     rf"{INIT_TIMEOUT} s; missing ranks \[2, 3\]\. ", re.M)
#: What a rank prints once it is in the phase struck (tests/worlds/host_fault.py).
IN_PHASE = {"compute": "COMPUTING", "collective": "COLLECTING", "init": "INIT"}


def _strike(lab, launcher, backend, fault, host="h2", phase="compute", bound=BOUND, launcher_wait=LAUNCHER_WAIT,
            nonzero=True, **kwargs):
    """strike, and check what every fault must give: the phase never ended, the ranks left ended within
    bound, nothing of the job left on their host, and (nonzero) the launcher's status, if it ended, not 0."""
    ended = strike(lab, launcher, backend, fault, host=host, phase=phase, compute=25, launcher_wait=launcher_wait,
                   SPMD_HEARTBEAT=str(BEAT), **kwargs)
    out = ended.output
    assert IN_PHASE[phase] in out and "DONE" not in out and "STARTED" not in out, out[-4000:]  # the phase never ended
    assert ended.ranks_end is not None and ended.ranks_end < bound, (ended.ranks_end, out[-4000:])
    assert ended.left == [], (ended.left, out[-4000:])  # nothing of the job left, its launcher's agent included
    if not ended.killed_launcher and nonzero:
        assert ended.statuses[0] != 0, out[-4000:]
    return ended, out


def _wait(launcher):
    return LAUNCHER_WAIT if launcher == "torchrun" else SHORT_WAIT


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
    waiting for h2's proxy: the test ends it after SHORT_WAIT s (docs/reliability.md measures how long
    it waited)."""
    ended, out = _strike(lab, "mpiexec", "mpi", fault, launcher_wait=_wait("mpiexec"))
    if fault == "kill":
        assert all(DIED.fullmatch(line) for line in re.findall(r"^### spmd: .*; ending.*$", out, re.M)), out[-4000:]
        assert ended.ranks_end < 5, ended.ranks_end
    else:
        assert len(SILENT.findall(out)) == 1, out[-4000:]
    if fault in ("drop", "kill"):  # Hydra still reaches h2's proxy, or saw it die
        assert not ended.killed_launcher, out[-4000:]


#: srun's rows with a test (a cut is silent as a freeze is; after a cut or a kill SLURM's stop takes 12 s
#: more, slurmd on h1 trying h2 for MessageTimeout): docs/reliability.md measures all eight.
SRUN_ROWS = [("gloo", "drop"), ("gloo", "freeze"), ("gloo", "kill"), ("mpi", "drop"), ("mpi", "freeze")]


@pytest.mark.parametrize("backend, fault", SRUN_ROWS)
def test_a_host_fault_under_srun_ends_the_ranks_left_and_names_the_host(lab, slurm, backend, fault):
    """srun from the login host over h1 and h2 (--mpi=none on gloo, --mpi=pmi2 on mpi).  Each fault ends
    h1's ranks within the bound, one report naming h2; every process of h2 killed includes its slurmd and
    slurmstepd, and the hub names h2's ranks as dead.  srun itself ends (75) after a partition, where it
    still reaches h2's slurmd, which sees h2's ranks end themselves; after a freeze or a kill it waits for
    SLURM to give up on h2 (docs/reliability.md)."""
    try:
        ended, out = _strike(lab, "srun", backend, fault, launcher_wait=SHORT_WAIT, tools={"slurm": slurm})
    finally:  # h2 down for SLURM and its processes gone: else SLURM's stop waits up to 27 s for a frozen slurmd
        slurm.run(["scontrol", "update", "nodename=h2", "state=down", "reason=struck"], check=False)
        lab.reset()
    said = SILENT.findall(out) if fault != "kill" else DIED.findall(out)
    assert len(said) == 1, out[-4000:]
    if fault == "drop":
        assert ended.statuses[0] == 75, out[-4000:]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_host_fault_under_open_mpi_ends_the_ranks_left(lab, openmpi, fault):
    """Open MPI's mpirun from the login host over h1 and h2 (its rsh agent entering each host), the mpi
    backend.  Silent faults: h1's ranks end within the bound, rank 0's one report names h2.  Every process of
    h2 killed (its prted included): mpirun ends every rank at once, before the hub can speak, with its own
    words ("A daemon failed to report back", naming h2) and status 0, which hides the failure from a script
    that reads it (docs/reliability.md)."""
    ended, out = _strike(lab, "openmpi", "mpi", fault, launcher_wait=SHORT_WAIT, tools={"openmpi": openmpi},
                          nonzero=fault != "kill")
    if fault == "kill":
        assert ended.ranks_end < 5 and ended.statuses[0] == 0, (ended.ranks_end, out[-4000:])
        assert re.search(r"A daemon failed to report back.*Remote host: +h2", out, re.S), out[-4000:]
    else:
        assert len(SILENT.findall(out)) == 1, out[-4000:]


@pytest.mark.parametrize("launcher, backend, fault", [("torchrun", "gloo", "freeze"), ("torchrun", "gloo", "kill"),
                                                       ("mpiexec", "mpi", "freeze")])
def test_a_host_fault_inside_a_loop_of_collectives_ends_the_ranks_left(lab, launcher, backend, fault):
    """The ranks all-reduce in a tight loop when h2 is struck: h1's ranks, inside a collective that waits for
    h2, end within the bound all the same (the hub's end reaches a rank blocked in gloo or in MPI), one
    report naming h2 (under mpiexec, written before any rank hears ABORT: docs/reliability.md)."""
    ended, out = _strike(lab, launcher, backend, fault, phase="collective", launcher_wait=_wait(launcher))
    said = SILENT.findall(out) if fault != "kill" else DIED.findall(out)
    assert len(said) == 1, out[-4000:]


@pytest.mark.parametrize("launcher, backend, fault", [("torchrun", "gloo", "freeze"), ("torchrun", "gloo", "kill"),
                                                       ("mpiexec", "mpi", "freeze")])
def test_a_host_fault_during_init_ends_the_ranks_left_within_the_timeout(lab, launcher, backend, fault):
    """h2's ranks start late (tests/worlds/host_fault.py's init phase) and h2 is struck while h1's ranks wait
    in spmd.init()'s rendezvous: there is no hub yet, so no heartbeat; h1's ranks end within SPMD_TIMEOUT
    (6 s here) + 10 s, rank 0 saying once which ranks never came (gloo: ranks 2, 3; MPICH's mpi,
    whose pair check waits in Hydra's barrier, can only say that not every rank started)."""
    ended, out = _strike(lab, launcher, backend, fault, phase="init", bound=INIT_TIMEOUT + 10,
                         launcher_wait=_wait(launcher), SPMD_TIMEOUT=str(INIT_TIMEOUT))
    if backend == "gloo":
        assert len(MISSING.findall(out)) == 1 and out.count("ranks arrived within") == 1, out[-4000:]
    else:
        assert out.count(f"not every one of the job's 4 ranks started within {INIT_TIMEOUT} s") == 1, out[-4000:]


@pytest.mark.parametrize("launcher, backend, fault", [("torchrun", "gloo", "cut"), ("torchrun", "gloo", "kill"),
                                                       ("mpiexec", "mpi", "cut"), ("mpiexec", "mpi", "kill")])
def test_rank_0s_host_failing_ends_the_ranks_left_each_naming_it(lab, launcher, backend, fault):
    """h1 struck (ranks 0, 1 and, under torchrun, the store's agent): h2's ranks end within the bound, each
    saying it lost rank 0 (on h1), once per rank left: no rank speaks for the others once rank 0 is gone.
    Under mpiexec, Hydra ends h2's other rank as soon as the first ends (after a cut), or every rank at once
    (every process of h1 killed, status 255), so one line, or none after the kill, may be all there is."""
    ended, out = _strike(lab, launcher, backend, fault, host="h1", launcher_wait=_wait(launcher))
    said = sorted((NO_RANK_0 if fault == "cut" else LOST_RANK_0).findall(out))
    assert set(said) <= {"2", "3"} and len(said) == len(set(said)), out[-4000:]  # once per rank at most
    if launcher == "torchrun":
        assert said == ["2", "3"], out[-4000:]
    elif fault == "cut":
        assert said, out[-4000:]
