"""Every launcher across the private cluster's hosts gives the single-host answer.

One world per launcher, backend and shape (2 hosts x 2 ranks, 3 hosts x 1) runs
tests/worlds/across.py: the guide's collectives, the main job, DataParallel and a split by host.
Its answers must be those of the same world on one host (MPICH's mpiexec on h3 alone, run once per
backend and size and kept for the module): the guide's lines word for word, the main job's
checksum, the trained parameters' sha256.  The hosts name themselves 127.0.1.1 and carry dock0 (the
same address on every host), so every rank must also have chosen eth0, and know its host.
"""

from __future__ import annotations

import re

import pytest

from tests.cluster.lab import SUBNET
from tests.cluster.runs import PY, env, hosts_rows, mpiexec
from tests.cluster.slurm import job_env
from tests.cluster.test_hosts import assert_on_the_shared_network, loopback_names
from tests.support import REPO, finish

pytestmark = pytest.mark.cluster

ACROSS = REPO / "tests" / "worlds" / "across.py"
SHAPES = {"2x2": (["h1", "h2"], 2), "3x1": (["h1", "h2", "h3"], 1)}
TIMEOUT = 240


class Answers:
    """What one run of across.py printed: the guide's lines, the checksum, the parameters' digest, the rows."""

    def __init__(self, out: str):
        guide = re.search(r"^== GUIDE ==\n(.*?)^== END GUIDE ==$", out, re.M | re.S)
        checksum = re.search(r"^checksum crc32c (\w+) \(input (\w+)\)$", out, re.M)
        digest = re.search(r"parameters identical on (\d+) ranks? \(sha256 (\w+)\)", out)
        assert guide and checksum and digest, f"across.py's answers are missing from:\n{out[-4000:]}"
        self.guide, self.checksum, self.digest = guide.group(1), checksum.groups(), digest.groups()
        self.rows = hosts_rows(out)


_alone: dict[tuple[str, int], Answers] = {}


def alone(lab, backend, n):
    """The answers of a world of n ranks on one host (h3), on backend: run once, kept for the module."""
    if (backend, n) not in _alone:
        out = mpiexec(lab, ["-n", str(n), "-ppn", str(n), PY, ACROSS], ["h3"], TIMEOUT, SPMD_BACKEND=backend)
        assert out.returncode == 0, out.stdout[-4000:]
        _alone[backend, n] = Answers(out.stdout)
    return _alone[backend, n]


def check(lab, out, backend, shape, launcher):
    """out (a finished run of across.py over shape) gives the single-host answers, from the right hosts."""
    hosts, per_host = SHAPES[shape]
    n = len(hosts) * per_host
    got = Answers(out)
    want = alone(lab, backend, n)
    assert got.guide == want.guide, f"the guide's lines differ from one host's:\n{got.guide}\n---\n{want.guide}"
    assert f"world size {n}, backend {backend}" in got.guide
    assert got.checksum == want.checksum
    assert got.digest == want.digest == (str(n), want.digest[1])
    rows = got.rows
    assert [r["rank"] for r in rows] == list(range(n))
    by_host = {h: [r for r in rows if r["host"] == h] for h in hosts}
    assert all(len(on_host) == per_host for on_host in by_host.values()), rows
    for on_host in by_host.values():  # one node number per host, distinct hosts distinct numbers
        assert len({r["node_rank"] for r in on_host}) == 1, rows
        assert sorted(r["local_rank"] for r in on_host) == list(range(per_host)), rows
        assert {r["local_size"] for r in on_host} == {per_host}, rows
    assert len({on_host[0]["node_rank"] for on_host in by_host.values()}) == len(hosts), rows
    assert {r["num_nodes"] for r in rows} == {len(hosts)}, rows
    assert {(r["backend"], r["launcher"]) for r in rows} == {(backend, launcher)}, rows
    assert_on_the_shared_network(rows)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_mpiexec(lab, backend, shape):
    """MPICH's mpiexec from the login host, Hydra entering each host (its launcher-exec)."""
    hosts, per_host = SHAPES[shape]
    loopback_names(lab)
    out = mpiexec(lab, ["-n", str(len(hosts) * per_host), "-ppn", str(per_host), PY, ACROSS], hosts, TIMEOUT,
                  SPMD_BACKEND=backend)
    assert out.returncode == 0, out.stdout[-4000:]
    check(lab, out.stdout, backend, shape, "mpich")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_open_mpi(lab, openmpi, backend, shape):
    """Open MPI's mpirun from the login host, its rsh agent entering each host; nothing set (spmd tells
    Open MPI's TCP transport the interface, which dock0 on every host would otherwise confuse)."""
    mpirun, python = openmpi
    hosts, per_host = SHAPES[shape]
    loopback_names(lab)
    hostfile = lab.dir / f"openmpi-{shape}"
    hostfile.write_text("".join(f"{h} slots={per_host}\n" for h in hosts))
    cmd = [mpirun, "--mca", "plm_rsh_agent", lab.enter, "--hostfile", hostfile, "--map-by", f"ppr:{per_host}:node",
           "-n", len(hosts) * per_host, python, ACROSS]
    out = finish(lab.popen("login", [str(c) for c in cmd],
                           env(SPMD_BACKEND=backend, OMPI_ALLOW_RUN_AS_ROOT="1",
                               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")),
                 TIMEOUT, "Open MPI's mpirun across the lab's hosts")
    assert out.returncode == 0, out.stdout[-4000:]
    check(lab, out.stdout, backend, shape, "openmpi")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backend, mpi", [("gloo", "none"), ("mpi", "pmi2")])
def test_srun(lab, slurm, backend, mpi, shape):
    """srun from the login host: plain (the rendezvous at the first node's name, which resolves to
    loopback there) on gloo, --mpi=pmi2 on mpi."""
    hosts, per_host = SHAPES[shape]
    loopback_names(lab)
    proc = slurm.srun(["-N", len(hosts), "-n", len(hosts) * per_host, "--ntasks-per-node", per_host,
                       f"--mpi={mpi}", PY, ACROSS], job_env(slurm, SPMD_BACKEND=backend))
    out = finish(proc, TIMEOUT, f"srun --mpi={mpi} across the lab's hosts")
    assert out.returncode == 0, out.stdout[-4000:]
    check(lab, out.stdout, backend, shape, "slurm" if mpi == "none" else "mpich")


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_bin_submit(lab, slurm, tmp_path, backend):
    """bin/submit from the login host, 2 nodes x 2 tasks: the batch script's srun starts the ranks
    (--mpi=pmi2 for the mpi backend), and the job's log holds the single-host answers."""
    loopback_names(lab)
    cmd = [str(REPO / "bin" / "submit"), "--wait", "--tail", "0", "-N", "2", "--ntasks-per-node", "2", "-t", "5",
           "--backend", backend, str(ACROSS)]
    out = finish(lab.popen("login", cmd, job_env(slurm, SPMD_PYTHON=PY), cwd=tmp_path), TIMEOUT,
                 "bin/submit across the lab's hosts")
    log = re.search(r"^job \S+ \S+, exit code \S+; log (.*)$", out.stdout, re.M)
    assert out.returncode == 0 and log, out.stdout[-4000:]
    check(lab, open(log[1]).read(), backend, "2x2", "slurm" if backend == "gloo" else "mpich")


@pytest.mark.parametrize("shape", SHAPES)
def test_torchrun(lab, shape):
    """One torchrun agent per host meeting through c10d's rendezvous at h1 (which agent gets which node
    rank is the rendezvous's choice), gloo.  h1's name resolves to 127.0.1.1 there, so its agent does
    not know that the endpoint is its own address and would host no store (every agent then waits
    for one, then fails): h1's agent is told so (--rdzv-conf is_host=1), as docs/reference.md says."""
    hosts, per_host = SHAPES[shape]
    loopback_names(lab)
    torchrun = str(REPO / ".venv" / "bin" / "torchrun")
    port = 29530 + len(hosts)
    agents = [lab.popen(host, [torchrun, "--nnodes", len(hosts), "--nproc-per-node", per_host,
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{SUBNET}.11:{port}",
                               "--rdzv-id", f"across-{shape}",
                               *(["--rdzv-conf", "is_host=1"] if host == "h1" else []), ACROSS], env())
              for host in hosts]
    outs = [finish(agent, TIMEOUT, f"torchrun on {host}").stdout for agent, host in zip(agents, hosts)]
    assert [a.returncode for a in agents] == [0] * len(hosts), "\n".join(o[-3000:] for o in outs)
    first = [o for o in outs if "== GUIDE ==" in o]
    assert len(first) == 1, "\n".join(o[-3000:] for o in outs)
    check(lab, first[0], "gloo", shape, "torchrun")
