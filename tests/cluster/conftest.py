"""The private cluster for the cluster tier: one lab for the session, every host reset after each test."""

import pytest

from tests.cluster.lab import Lab, LabUnavailable
from tests.cluster.slurm import LabSlurm
from tests.submit.slurm_cluster import SlurmUnavailable
from tests.support import missing


@pytest.fixture(scope="session")
def cluster_lab():
    """Three compute hosts (each with the dock0 trap: the same address on every host), a login host
    and an outsider, up for the whole session."""
    try:
        lab = Lab.start(hosts=3, dummy=True, outsider=True)
    except LabUnavailable as exc:
        missing(f"no private cluster here: {exc}")
    yield lab
    lab.stop()


@pytest.fixture
def lab(cluster_lab):
    """The session's lab, every host as at start before and after the test."""
    cluster_lab.reset()
    yield cluster_lab
    cluster_lab.reset()


@pytest.fixture
def slurm(lab):
    """SLURM on the lab's hosts, started after the lab's reset (which ends every process of a host)
    and stopped before the next; a start takes about a second."""
    try:
        cluster = LabSlurm.start_on(lab)
    except SlurmUnavailable as exc:
        missing(f"no SLURM on the private cluster: {exc}")
    yield cluster
    cluster.stop()
