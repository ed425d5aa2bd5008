"""A real SLURM across the private cluster's hosts: slurmctld on the login host, a slurmd per host.

srun and bin/submit start ranks on h1..h3, each host naming itself 127.0.1.1 and carrying dock0
(the same address on every host): spmd must meet on eth0, and know which ranks share a host.
"""

import re

import pytest

from tests.cluster.runs import HOSTS_PY, PY, hosts_rows
from tests.cluster.slurm import job_env
from tests.cluster.test_hosts import assert_on_the_shared_network, loopback_names
from tests.submit.slurm_cluster import _which as slurm_bin
from tests.support import BIN, REPO, finish

pytestmark = pytest.mark.cluster

SUBMIT = REPO / "bin" / "submit"


@pytest.mark.parametrize("backend, mpi", [("gloo", "none"), ("mpi", "pmi2")])
def test_srun_across_hosts(lab, slurm, backend, mpi):
    """srun -N 2 -n 4 (3 tasks on h1, 1 on h2): the rendezvous of plain srun at the first node's name,
    which resolves to loopback there, and MPI under --mpi=pmi2; placement and address from the hosts."""
    loopback_names(lab)
    proc = slurm.srun(["-N", "2", "-n", "4", f"--mpi={mpi}", PY, HOSTS_PY], job_env(slurm, SPMD_BACKEND=backend))
    out = finish(proc, 240, f"srun --mpi={mpi} across the lab's hosts")
    assert out.returncode == 0, out.stdout[-4000:]
    rows = hosts_rows(out.stdout)
    assert [(r["host"], r["node_rank"], r["local_rank"], r["local_size"]) for r in rows] == [
        ("h1", 0, 0, 3), ("h1", 0, 1, 3), ("h1", 0, 2, 3), ("h2", 1, 0, 1)]
    assert_on_the_shared_network(rows)
    assert {r["backend"] for r in rows} == {backend}
    assert {r["launcher"] for r in rows} == {"slurm" if mpi == "none" else "mpich"}


def test_a_users_pytest_file_under_srun_across_hosts(lab, slurm, tmp_path):
    """The spmd pytest plugin in a world of 4 that srun spreads over h1 and h2 (plain srun, gloo)."""
    from tests.testing.runs import UNDER_A_WORLD_OF_4, cases, user_dir

    loopback_names(lab)
    where = user_dir(tmp_path, "user")
    junit = where / "junit.xml"
    cmd = [slurm_bin("srun"), "-N", "2", "-n", "4", "--ntasks-per-node", "2", PY, "-m", "pytest", "-rA",
           "-p", "no:cacheprovider", f"--junitxml={junit}"]
    finish(lab.popen("login", cmd, job_env(slurm), cwd=where), 300, "pytest under srun across hosts")
    assert {name: outcome for name, (outcome, _, _) in cases(junit).items()} == UNDER_A_WORLD_OF_4


def test_srun_runs_spmd_doctor_across_hosts(lab, slurm):
    """srun -N 3 spmd doctor (the console script; plain srun meets through the rendezvous store)."""
    loopback_names(lab)
    proc = slurm.srun(["-N", "3", "-n", "3", str(BIN / "spmd"), "doctor"], job_env(slurm))
    out = finish(proc, 240, "srun spmd doctor across the lab's hosts")
    assert out.returncode == 0, out.stdout[-4000:]
    assert "spmd doctor: 3 hosts, 3 ranks, started by slurm" in out.stdout, out.stdout[-4000:]
    assert out.stdout.count("spmd doctor:") == 1 and "ok: nothing found would stop a job (3 warnings)" in out.stdout
    assert all(f"warning: {h} resolves its own name to 127.0.1.1" in out.stdout for h in ("h1", "h2", "h3"))


def test_bin_submit_preflight_ends_the_job_with_the_doctors_table_on_a_partition(lab, slurm, tmp_path):
    """bin/submit --preflight with h2 and h3 dropping each other's packets: the batch job's first step
    names the pair, and the job itself never starts."""
    lab.drop("h2", "h3")
    cmd = [str(SUBMIT), "--wait", "--tail", "0", "--preflight", "-N", "3", "--ntasks-per-node", "1", "-t", "5",
           str(REPO / "jobs" / "collectives.py")]
    out = finish(lab.popen("login", cmd, job_env(slurm, SPMD_PYTHON=PY), cwd=tmp_path), 240,
                 "bin/submit --preflight across the lab's hosts")
    assert out.returncode != 0, out.stdout[-4000:]
    log = re.search(r"^job \S+ \S+, exit code \S+; log (.*)$", out.stdout, re.M)
    assert log, out.stdout
    text = open(log[1]).read()
    assert re.search(r"^error: h2 <-> h3: no answer within 2 s", text, re.M), text[-3000:]
    assert "spmd: the preflight failed (spmd doctor's table above); the job did not start" in text, text[-3000:]
    assert "Reduced result" not in text
