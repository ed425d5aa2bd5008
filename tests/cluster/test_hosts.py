"""Every launcher across the private cluster's hosts gives the single-host answer, on the right network.

The hosts carry the traps users meet (tests/cluster/lab.py): each has a second interface, dock0,
holding the same address as every other host's; most tests also make each host name itself
127.0.1.1, as Debian does.  spmd must still choose eth0's address, the one the hosts share.
"""

import ipaddress
import os
import subprocess
import re

import pytest

from tests.cluster.lab import SUBNET
from tests.cluster.runs import HOSTS_PY, PY, Watched, env, hosts_rows, mpiexec, on
from tests.support import REPO, finish

pytestmark = pytest.mark.cluster

NETWORK = ipaddress.ip_network(f"{SUBNET}.0/24")


def loopback_names(lab, hosts=("h1", "h2", "h3")):
    for host in hosts:
        lab.names(host, loopback=True)


def assert_on_the_shared_network(rows):
    for row in rows:
        assert ipaddress.ip_address(row["address"]) in NETWORK, row
        assert row["interface"] == "eth0" and row["gloo"] == "eth0", row


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_cut_link_stops_traffic_between_hosts(lab, tmp_path, backend):
    """The lab is honest: MPI and gloo between two hosts go over their network (no shared memory behind
    it): an all-reduce waits while h2's link is cut, and completes once it is mended."""
    flag = tmp_path / "go"
    job = Watched(lab.popen("login", lab.mpiexec_args(
        str(REPO / ".venv" / "bin" / "mpiexec"),
        ["-n", "2", "-ppn", "1", PY, REPO / "tests/worlds/cut_link.py", flag, backend], ["h1", "h2"]),
        env(MASTER_ADDR=f"{SUBNET}.11", MASTER_PORT="29611", GLOO_SOCKET_IFNAME="eth0")))
    try:
        job.wait_for(r"READY \d", count=2, timeout=120)
        lab.cut("h2")
        flag.touch()
        out = job.drain(6)
        assert "DONE" not in out, f"an all-reduce crossed a cut link:\n{out}"
        lab.mend("h2")
        job.wait_for(r"DONE \d 2\.0", count=2, timeout=60)  # and the link was all that stopped it
    finally:
        job.kill()


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_mpiexec_across_hosts_on_the_shared_network(lab, backend):
    """2 hosts x 2 ranks under Hydra, hosts naming themselves 127.0.1.1: the guide's collectives give
    the single-host output, ranks know their hosts, and every rank uses eth0's address."""
    loopback_names(lab)
    across = mpiexec(lab, ["-n", "4", "-ppn", "2", PY, HOSTS_PY], ["h1", "h2"], SPMD_BACKEND=backend)
    assert across.returncode == 0, across.stdout[-4000:]
    rows = hosts_rows(across.stdout)
    assert [(r["host"], r["node_rank"], r["local_rank"], r["local_size"], r["num_nodes"]) for r in rows] == [
        ("h1", 0, 0, 2, 2), ("h1", 0, 1, 2, 2), ("h2", 1, 0, 2, 2), ("h2", 1, 1, 2, 2)]
    assert_on_the_shared_network(rows)
    assert {r["backend"] for r in rows} == {backend}
    guide = mpiexec(lab, ["-n", "4", "-ppn", "2", PY, REPO / "jobs/collectives.py"], ["h1", "h2"],
                    SPMD_BACKEND=backend)
    alone = mpiexec(lab, ["-n", "4", "-ppn", "4", PY, REPO / "jobs/collectives.py"], ["h3"], SPMD_BACKEND=backend)
    assert guide.returncode == 0 and alone.returncode == 0, guide.stdout[-3000:] + alone.stdout[-3000:]
    assert "Reduced result on rank 0: 10.0" in alone.stdout
    assert guide.stdout == alone.stdout


def test_round_robin_and_uneven_placement_come_from_the_hosts(lab):
    """Hydra's round-robin over 3 hosts (ranks 0 and 3 on h1): node and local numbers from where ranks
    run, and split by node_rank gives the ranks that share a machine."""
    loopback_names(lab)
    out = mpiexec(lab, ["-n", "4", PY, HOSTS_PY], ["h1", "h2", "h3"])
    assert out.returncode == 0, out.stdout[-4000:]
    rows = hosts_rows(out.stdout)
    assert [(r["host"], r["node_rank"], r["local_rank"], r["local_size"]) for r in rows] == [
        ("h1", 0, 0, 2), ("h2", 1, 0, 1), ("h3", 2, 0, 1), ("h1", 0, 1, 2)]
    assert {r["num_nodes"] for r in rows} == {3}
    assert_on_the_shared_network(rows)


def test_three_hosts_one_rank_each_run_the_main_job_to_the_single_host_checksum(lab):
    """3 hosts x 1 rank: scatter_gather's output checksum is the one a world of one computes."""
    job = [REPO / "jobs/scatter_gather.py", "--rows", "60000", "--chunk-rows", "8192"]
    across = mpiexec(lab, ["-n", "3", "-ppn", "1", PY, *job], ["h1", "h2", "h3"])
    alone = on(lab, "h1", [PY, *job])
    assert across.returncode == 0 and alone.returncode == 0, across.stdout[-3000:] + alone.stdout[-3000:]
    checksum = lambda out: re.search(r"checksum crc32c (\w+) \(input (\w+)\)", out).groups()  # noqa: E731
    assert checksum(across.stdout) == checksum(alone.stdout)
    assert "3 ranks" in across.stdout


def test_torchrun_across_hosts_chooses_eth0_for_gloo(lab):
    """One torchrun agent per host (static rendezvous at h1's address), hosts naming themselves
    127.0.1.1: gloo's sockets on eth0, not loopback (gloo's 'connectFullMesh ... remote=[127.0.0.1]')."""
    loopback_names(lab)
    torchrun = str(REPO / ".venv" / "bin" / "torchrun")
    agents = [lab.popen(host, [torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(i),
                               "--master-addr", f"{SUBNET}.11", "--master-port", "29517", HOSTS_PY], env())
              for i, host in enumerate(["h1", "h2"])]
    outs = [a.communicate(timeout=180)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-3000:] for o in outs)
    rows = hosts_rows(outs[0])
    assert [(r["host"], r["node_rank"], r["local_rank"]) for r in rows] == [
        ("h1", 0, 0), ("h1", 0, 1), ("h2", 1, 0), ("h2", 1, 1)]
    assert_on_the_shared_network(rows)
    assert {r["launcher"] for r in rows} == {"torchrun"}


def test_a_host_that_cannot_resolve_its_own_name_still_runs(lab):
    """Under MPI spmd needs no host name: rank 0's host without its own name in /etc/hosts works."""
    lab.names("h1", own=False)
    out = mpiexec(lab, ["-n", "2", "-ppn", "1", PY, HOSTS_PY], ["h1", "h2"], SPMD_BACKEND="gloo")
    assert out.returncode == 0, out.stdout[-4000:]
    assert_on_the_shared_network(hosts_rows(out.stdout))


def test_spmd_ifname_picks_the_interface(lab):
    """SPMD_IFNAME=eth0 on hosts with the right names: taken as given, and said so."""
    out = mpiexec(lab, ["-n", "2", "-ppn", "1", PY, HOSTS_PY], ["h1", "h2"], SPMD_BACKEND="gloo",
                  SPMD_IFNAME="eth0")
    assert out.returncode == 0, out.stdout[-4000:]
    rows = hosts_rows(out.stdout)
    assert_on_the_shared_network(rows)
    assert {r["why"] for r in rows} == {"SPMD_IFNAME=eth0"}


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_open_mpi_across_hosts_with_spmd_ifname(lab, openmpi, backend):
    """Open MPI's mpirun over 2 hosts x 2 (its rsh agent enters each host), hosts naming themselves
    127.0.1.1: SPMD_IFNAME=eth0 is told to Open MPI's TCP transport too, which dock0's address on
    every host otherwise confuses ('received unexpected process identifier')."""
    mpirun, python = openmpi
    loopback_names(lab)
    hostfile = lab.dir / "openmpi-hosts"
    hostfile.write_text("h1 slots=2\nh2 slots=2\n")
    cmd = [mpirun, "--mca", "plm_rsh_agent", lab.enter, "--hostfile", hostfile, "--map-by", "ppr:2:node",
           "-n", "4", python, HOSTS_PY]
    out = finish(lab.popen("login", [str(c) for c in cmd], env(SPMD_BACKEND=backend, SPMD_IFNAME="eth0",
                                                                  OMPI_ALLOW_RUN_AS_ROOT=1,
                                                                  OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)),
                 180, "Open MPI's mpirun across the lab's hosts")
    assert out.returncode == 0, out.stdout[-4000:]
    rows = hosts_rows(out.stdout)
    assert [(r["host"], r["node_rank"], r["local_rank"]) for r in rows] == [
        ("h1", 0, 0), ("h1", 0, 1), ("h2", 1, 0), ("h2", 1, 1)]
    assert_on_the_shared_network(rows)
    assert {(r["backend"], r["launcher"]) for r in rows} == {(backend, "openmpi")}


def test_data_parallel_across_hosts_ends_with_the_single_host_parameters(lab):
    """jobs/train_dp.py on 2 hosts x 2 ranks (gloo) ends with the parameters (sha256) that 4 ranks on
    one host reach: gloo's ring sums in the same order wherever the ranks run."""
    loopback_names(lab)
    job = [PY, REPO / "jobs/train_dp.py", "--steps", "4", "--global-batch", "8", "--vocab", "512"]
    across = mpiexec(lab, ["-n", "4", "-ppn", "2", *job], ["h1", "h2"], SPMD_BACKEND="gloo")
    alone = mpiexec(lab, ["-n", "4", "-ppn", "4", *job], ["h3"], SPMD_BACKEND="gloo")
    assert across.returncode == 0 and alone.returncode == 0, across.stdout[-3000:] + alone.stdout[-3000:]
    digest = lambda out: re.search(r"parameters identical on 4 ranks \(sha256 (\w+)\)", out).group(1)  # noqa: E731
    assert digest(across.stdout) == digest(alone.stdout)


def test_a_users_pytest_file_under_mpiexec_across_hosts(lab, tmp_path):
    """The spmd pytest plugin in a world of 4 over 2 hosts: the outcomes it has in a world of 4 on one."""
    from tests.testing.runs import UNDER_A_WORLD_OF_4, cases, user_dir

    where = user_dir(tmp_path, "user")
    junit = where / "junit.xml"
    cmd = lab.mpiexec_args(str(REPO / ".venv" / "bin" / "mpiexec"),
                           ["-n", "4", "-ppn", "2", PY, "-m", "pytest", "-rA", "-p", "no:cacheprovider",
                            f"--junitxml={junit}"], ["h1", "h2"])
    finish(lab.popen("login", cmd, env(), cwd=where), 300, "pytest under mpiexec across hosts")
    assert {name: outcome for name, (outcome, _, _) in cases(junit).items()} == UNDER_A_WORLD_OF_4


def test_a_repl_with_ranks_on_two_hosts(lab):
    """python -m spmd.repl under mpiexec over h1 and h2 (names resolving to loopback): every statement
    runs on every rank, and each answers from its own host."""
    loopback_names(lab)
    cmd = lab.mpiexec_args(str(REPO / ".venv" / "bin" / "mpiexec"), ["-n", "4", "-ppn", "2", PY, "-m", "spmd.repl"],
                           ["h1", "h2"])
    proc = lab.popen("login", cmd, env(), stdin=subprocess.PIPE)
    try:
        out, _ = proc.communicate("import socket\nsocket.gethostname(), comm.node_rank\n", timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        pytest.fail(f"the REPL did not end: {proc.communicate()[0][-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    assert "[0-1] ('h1', 0)" in out and "[2-3] ('h2', 1)" in out, out[-3000:]
