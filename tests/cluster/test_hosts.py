"""Across the private cluster's hosts: placement from where ranks run, the network spmd chooses, a
user's pytest file and the REPL (every launcher's single-host answers: test_launchers.py).

The hosts carry the traps users meet (tests/cluster/lab.py): each has a second interface, dock0,
holding the same address as every other host's; most tests also make each host name itself
127.0.1.1, as Debian does.  spmd must still choose eth0's address, the one the hosts share.
"""

import ipaddress
import os
import subprocess

import pytest

from tests.cluster.lab import SUBNET
from tests.cluster.runs import HOSTS_PY, PY, Watched, env, hosts_rows, mpiexec
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
