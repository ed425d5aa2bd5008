"""spmd finds the shared network itself on hosts with several interfaces, of which only one reaches the others.

Here each host has three besides loopback, ahead of eth0 in interface order: dock0 (the same
address on every host, as docker0), and lan1, up, with an address of its own on a network of its
own (198.19.N.1/24 on hN) that goes nowhere (tests/cluster/lab.py, ``isolate``).  The hosts name
themselves 127.0.1.1.  Under mpiexec and torchrun, on gloo, every rank must still choose eth0; under
Open MPI, on gloo and mpi, with no SPMD_IFNAME, Open MPI's own TCP transport must be told eth0 too.
"""

import ipaddress
import re
import subprocess

import pytest

from tests.cluster.lab import ISOLATED, SUBNET
from tests.cluster.runs import HOSTS_PY, PY, env, hosts_rows, mpiexec, on
from tests.support import REPO, finish

pytestmark = pytest.mark.cluster

NETWORK = ipaddress.ip_network(f"{SUBNET}.0/24")
PROBE = ("import socket, sys\ns = socket.socket(); s.settimeout(3)\ns.bind((sys.argv[1], 0))\n"
         "try:\n    s.connect((sys.argv[2], 9)); print('CONNECTED')\nexcept OSError as e:\n    print('NO', e)\n")


@pytest.fixture
def isolated(lab):
    """h1 and h2 with lan1 each (lab.reset removes it), naming themselves 127.0.1.1."""
    for host in ("h1", "h2"):
        lab.isolate(host)
        lab.names(host, loopback=True)
    return lab


def assert_on_eth0(rows):
    for row in rows:
        assert ipaddress.ip_address(row["address"]) in NETWORK, row
        assert row["interface"] == "eth0" and row["gloo"] == "eth0", row
        assert row["why"].startswith(f"on {NETWORK}, the network every other host"), row


def test_the_isolated_interface_is_up_ahead_of_eth0_and_reaches_no_other_host(isolated):
    """The trap is real: lan1 up before eth0 on each host, and nothing on another host is reached through it."""
    lab = isolated
    shown = on(lab, "h1", ["sh", "-c", "cat /sys/class/net/lan1/carrier; ip -o -4 addr show"], timeout=30).stdout
    assert shown.startswith("1\n"), shown
    order = [line.split()[1] for line in shown.splitlines()[1:]]
    assert order.index("lan1") < order.index("eth0"), shown
    assert f"{ISOLATED}.1.1/24" in shown
    probe = on(lab, "h1", [PY, "-c", PROBE, f"{ISOLATED}.1.1", f"{ISOLATED}.2.1"], timeout=30).stdout
    assert probe.startswith("NO "), probe


def test_mpiexec_on_gloo_chooses_eth0_over_an_isolated_interface(isolated):
    """2 hosts x 2 ranks under MPICH's Hydra: every rank on eth0, none on lan1 or dock0."""
    out = mpiexec(isolated, ["-n", "4", "-ppn", "2", PY, HOSTS_PY], ["h1", "h2"], SPMD_BACKEND="gloo")
    assert out.returncode == 0, out.stdout[-4000:]
    rows = hosts_rows(out.stdout)
    assert [(r["host"], r["node_rank"], r["local_rank"]) for r in rows] == [
        ("h1", 0, 0), ("h1", 0, 1), ("h2", 1, 0), ("h2", 1, 1)]
    assert_on_eth0(rows)
    assert {(r["backend"], r["launcher"]) for r in rows} == {("gloo", "mpich")}


def test_torchrun_on_gloo_chooses_eth0_over_an_isolated_interface(isolated):
    """One torchrun agent per host (static rendezvous at h1's eth0 address): gloo's sockets on eth0."""
    torchrun = str(REPO / ".venv" / "bin" / "torchrun")
    agents = [isolated.popen(host, [torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(i),
                                    "--master-addr", f"{SUBNET}.11", "--master-port", "29519", HOSTS_PY],
                             env(SPMD_BACKEND="gloo"))
              for i, host in enumerate(["h1", "h2"])]
    done = [finish(a, 180, f"torchrun's agent on h{i + 1}") for i, a in enumerate(agents)]
    assert [d.returncode for d in done] == [0, 0], "\n".join(d.stdout[-3000:] for d in done)
    rows = hosts_rows(done[0].stdout)
    assert [(r["host"], r["node_rank"], r["local_rank"]) for r in rows] == [
        ("h1", 0, 0), ("h1", 0, 1), ("h2", 1, 0), ("h2", 1, 1)]
    assert_on_eth0(rows)
    assert {(r["backend"], r["launcher"]) for r in rows} == {("gloo", "torchrun")}


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_open_mpi_without_spmd_ifname_is_told_eth0(isolated, openmpi, backend):
    """Open MPI's mpirun over 2 hosts x 2 with nothing set: spmd tells Open MPI's TCP transport the interface
    its own daemon reached the other hosts by (eth0), before MPI_Init.  Untold, dock0 and lan1 confuse
    it: 'accepted a TCP connection from ... another Open MPI process but cannot find a corresponding
    process entry', and the job hangs."""
    mpirun, python = openmpi
    hostfile = isolated.dir / "openmpi-hosts"
    hostfile.write_text("h1 slots=2\nh2 slots=2\n")
    cmd = [mpirun, "--mca", "plm_rsh_agent", isolated.enter, "--hostfile", hostfile, "--map-by", "ppr:2:node",
           "-n", "4", python, HOSTS_PY]
    out = finish(isolated.popen("login", [str(c) for c in cmd], env(
        SPMD_BACKEND=backend, OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)),
        180, "Open MPI's mpirun across the lab's hosts")
    assert out.returncode == 0, out.stdout[-4000:]
    rows = hosts_rows(out.stdout)
    assert [(r["host"], r["node_rank"], r["local_rank"]) for r in rows] == [
        ("h1", 0, 0), ("h1", 0, 1), ("h2", 1, 0), ("h2", 1, 1)]
    assert_on_eth0(rows)
    assert {(r["backend"], r["launcher"], r["ompi_btl"]) for r in rows} == {(backend, "openmpi", "eth0")}


def test_spmd_info_under_mpiexec_shows_each_ranks_host_address_and_why_once(isolated):
    """spmd info as a job, round-robin over h1 and h2 (ranks 0 and 2 on h1): rank 0 alone prints a row per
    rank, its host and node numbers measured, the address and interface it chose, and why."""
    spmd = str(REPO / ".venv" / "bin" / "spmd")
    out = mpiexec(isolated, ["-n", "4", spmd, "info"], ["h1", "h2"], SPMD_BACKEND="gloo")
    assert out.returncode == 0, out.stdout[-4000:]
    text = out.stdout
    assert text.count("ranks (placement measured from where each rank runs, not rank arithmetic: ranks grouped "
                      "by host over MPI):") == 1, text[-4000:]
    assert text.count("backends:") == 1 and "backend: gloo" in text, text[-4000:]
    rows = re.findall(r"^  (\d+) +(h\d) +(\d/\d) +(\d/\d) +(\S+) +(\S+) +(.*)$", text, re.M)
    assert [r[:6] for r in rows] == [
        ("0", "h1", "0/2", "0/2", f"{SUBNET}.11", "eth0"), ("1", "h2", "1/2", "0/2", f"{SUBNET}.12", "eth0"),
        ("2", "h1", "0/2", "1/2", f"{SUBNET}.11", "eth0"), ("3", "h2", "1/2", "1/2", f"{SUBNET}.12", "eth0")], text
    assert all(r[6].startswith(f"on {NETWORK}, the network every other host (h") for r in rows), rows


def test_reset_removes_the_isolated_interface_and_its_namespace(isolated):
    isolated.reset()
    shown = on(isolated, "h1", ["ip", "-o", "link", "show"], timeout=30).stdout
    assert "lan1" not in shown and "eth0" in shown, shown
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{isolated.host('h1').netns}-lan" not in spaces
