"""The soak across hosts (tests/cluster/soak.py) in small: 6 jobs over the lab's three hosts, one of each
kind (a success, a lossy link, and a host cut, partitioned, frozen and killed), the launchers drawn
among MPICH's mpiexec (mpi and gloo) and torchrun.

Every job as promised (a fault: the ranks on the hosts left gone within the bound, the struck host
named, no launcher left exiting 0, everything gone once the fault is healed), and nothing left on any
host: no process, port, unix socket, /dev/shm entry or temporary file.  docs/reliability.md ("A soak
across hosts") has the table of 100 jobs.
"""

import pytest

from tests.cluster import soak

pytestmark = pytest.mark.cluster

JOBS, SEED = 6, 4


@pytest.mark.timeout(420)
def test_a_short_soak_across_hosts_keeps_every_promise_and_leaves_nothing_on_any_host(lab, tmp_path):
    jobs = soak.draw(JOBS, SEED)
    assert {j.kind for j in jobs} == set(soak.KINDS) and len({j.launcher for j in jobs}) == len(soak.LAUNCHERS)
    results = soak.soak(lab, jobs, tmp_path)
    text = soak.table(results) + soak.details(results)
    assert [r.job for r in results] == jobs, text
    assert not [r.job.index for r in results if r.unexpected], text
    for r in results:
        for category in soak.CATEGORIES:
            if category not in soak.LAUNCHERS_OWN:
                assert r.left[category] == [], (r.job, category, text)
        if r.job.kind in soak.FAULTS:
            assert r.ended is not None and r.ended <= soak.BOUND and r.healed is not None, text
    rows = soak.read_table(text)
    assert rows[-1]["kind"] == "**all**" and rows[-1]["jobs"] == str(JOBS) and rows[-1]["unexpected"] == "0", text
