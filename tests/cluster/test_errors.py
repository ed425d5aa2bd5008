"""Errors at init across the private cluster's hosts, under every launcher: each names the real cause (a
loopback address, a refused port, a name that does not resolve, a partition), is said once, ends the
job with a status that is not 0, and, where the cause is certain, comes within seconds.

A bound starts at the promise (docs/testing.md, "Time bounds"): tests/worlds/timed_init.py prints it
after the imports init would make, then starts spmd.  Where spmd never runs (torchrun's own store
fails first), the test asserts torchrun's words: docs/reliability.md says what each launcher shows.
"""

import re
import time

import pytest

from tests.cluster.lab import SUBNET
from tests.cluster.runs import HOSTS_PY, PY, env, mpiexec
from tests.cluster.slurm import job_env
from tests.support import REPO, finish, since_promise

pytestmark = pytest.mark.cluster

TIMED_PY = REPO / "tests" / "worlds" / "timed_init.py"
TORCHRUN = str(REPO / ".venv" / "bin" / "torchrun")
#: Seconds from the promise to the job's end, where the cause is certain: SPMD_TIMEOUT is 60 s (runs.env).
PROMPT = 20
#: What each case sets, the words its report must hold, and whether its cause is certain (prompt).
CASES = {
    "loopback": ({"MASTER_ADDR": "127.0.0.1"}, ["127.0.0.1", "loopback"]),
    "refused": ({"MASTER_ADDR": f"{SUBNET}.11", "MASTER_PORT": "29601"}, ["port 29601 refused"]),
    "name": ({"MASTER_ADDR": "nosuchhost"}, ["MASTER_ADDR='nosuchhost' does not resolve", "/etc/hosts"]),
}


def _init_error(out):
    """The one report of an error every rank met at init, and how many times it was said."""
    return out.count("### spmd: init failed on every rank"), out


def _reports(out):
    """How many reports of spmd's the output holds (each begins '### spmd:')."""
    return out.count("### spmd:")


def _timed(proc, seconds, what):
    """finish(proc) and the seconds from its first promise line to its end."""
    out = finish(proc, seconds, what)
    return out, since_promise(out.stdout, time.monotonic())


# -- MPICH's mpiexec -------------------------------------------------------------------------------


def test_a_loopback_rendezvous_across_hosts_is_named_at_once_and_once(lab):
    """MASTER_ADDR=127.0.0.1 with ranks on two hosts: an error naming the loopback address and the host
    that cannot reach it, said once, in seconds rather than after SPMD_TIMEOUT (60 s here)."""
    out = mpiexec(lab, ["-n", "4", "-ppn", "2", PY, TIMED_PY], ["h1", "h2"], SPMD_BACKEND="gloo",
                  MASTER_ADDR="127.0.0.1")
    took = since_promise(out.stdout, time.monotonic())
    count, text = _init_error(out.stdout)
    assert out.returncode != 0 and count == 1, text[-4000:]
    assert "127.0.0.1" in text and "loopback" in text and "ranks 2, 3 on h2" in text
    assert "Traceback" not in text
    assert took is not None and took < PROMPT, f"took {took} s from the promise, as if it waited for the timeout"


def test_a_refused_port_is_named_as_a_port(lab):
    """A firewall on h1 rejects the rendezvous port from h2: the error says the port was refused, at
    once (rank 0 listens before it publishes its address over MPI: a refusal is certain)."""
    lab.reject("h1", "h2", 29601)
    out = mpiexec(lab, ["-n", "2", "-ppn", "1", PY, TIMED_PY], ["h1", "h2"], SPMD_BACKEND="gloo",
                  MASTER_ADDR=f"{SUBNET}.11", MASTER_PORT="29601")
    took = since_promise(out.stdout, time.monotonic())
    count, text = _init_error(out.stdout)
    assert out.returncode != 0 and count == 1, text[-4000:]
    assert "port 29601 refused" in text and "rank 1 on h2" not in text and "ranks 1 on h2" in text
    assert took is not None and took < PROMPT, f"took {took} s from the promise"


def test_a_name_that_does_not_resolve_is_named_as_a_name_under_mpiexec(lab):
    """MASTER_ADDR=nosuchhost: rank 0 finds it, says it once for every rank, as a name (not a port)."""
    out = mpiexec(lab, ["-n", "2", "-ppn", "1", PY, TIMED_PY], ["h1", "h2"], SPMD_BACKEND="gloo",
                  MASTER_ADDR="nosuchhost")
    took = since_promise(out.stdout, time.monotonic())
    count, text = _init_error(out.stdout)
    assert out.returncode != 0 and count == 1 and _reports(text) == 1, text[-4000:]
    said = text.split("### spmd: init failed on every rank")[1].splitlines()[1]
    assert "MASTER_ADDR='nosuchhost' does not resolve on h1" in said and "port" not in said, text[-4000:]
    assert took is not None and took < PROMPT, f"took {took} s from the promise"


def test_a_partition_is_named_before_mpich_mpi_init_without_preflight(lab):
    """mpiexec over h1..h3, h2 and h3 dropping each other's packets, default settings (the mpi backend)
    but SPMD_TIMEOUT=30: the pair check before MPI_Init, over Hydra's key-value space, names both
    directions of the pair, once, within seconds of the promise, where MPI_Init would wait out
    SPMD_TIMEOUT and then have every rank say it timed out, naming no pair."""
    lab.drop("h2", "h3")
    out = mpiexec(lab, ["-n", "3", "-ppn", "1", PY, TIMED_PY], ["h1", "h2", "h3"], timeout=150, SPMD_TIMEOUT="30")
    took = since_promise(out.stdout, time.monotonic())
    count, text = _init_error(out.stdout)
    assert out.returncode != 0 and count == 1 and _reports(text) == 1, text[-4000:]
    assert re.search(r"h2 -> h3: 198\.18\.0\.13:\d+ \(eth0\): no answer within 5 s", text), text[-4000:]
    assert re.search(r"h3 -> h2: 198\.18\.0\.12:\d+ \(eth0\)", text) and "h1 ->" not in text, text[-4000:]
    assert "MPI_Init did not complete" not in text and "HOSTS " not in text
    assert took is not None and took < PROMPT, f"took {took} s from the promise"


def test_a_rank_that_never_starts_is_said_once_before_mpich_mpi_init(lab):
    """mpiexec over h1..h3, rank 1 (on h2) never coming to init (tests/worlds/faults.py late), SPMD_TIMEOUT=10:
    the barrier of the pair check before MPI_Init runs out on rank 0 first, which says so once and ends
    the job (the late rank included) by its own SIGKILL, where each rank's MPI_Init watcher said it."""
    out = mpiexec(lab, ["-n", "3", "-ppn", "1", PY, REPO / "tests/worlds/faults.py", "late"], ["h1", "h2", "h3"],
                  timeout=150, SPMD_TIMEOUT="10")
    took = since_promise(out.stdout, time.monotonic())
    count, text = _init_error(out.stdout)
    assert out.returncode != 0 and count == 1 and _reports(text) == 1, text[-4000:]
    assert "not every one of the job's 3 ranks started within 10 s" in text, text[-4000:]
    assert "READY" not in text and took is not None and took < 10 + PROMPT, f"took {took} s from the promise"


def test_a_wrong_interface_name_lists_the_host_interfaces(lab):
    """SPMD_IFNAME=ib0 on hosts without it: an error before MPI_Init (where UCX would fail on it,
    unexplained), naming the variable and the host's interfaces."""
    out = mpiexec(lab, ["-n", "2", "-ppn", "1", PY, HOSTS_PY], ["h1", "h2"], SPMD_BACKEND="gloo",
                  SPMD_IFNAME="ib0")
    assert out.returncode != 0, out.stdout[-4000:]
    assert "SPMD_IFNAME=ib0 names no interface of host h1" in out.stdout, out.stdout[-4000:]
    assert "eth0 (198.18.0.11)" in out.stdout and "dock0" in out.stdout and "UCX" not in out.stdout


# -- Open MPI's mpirun -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_open_mpi_errors_name_the_cause_once_and_at_once(lab, openmpi, case):
    """Open MPI's mpirun over 2 hosts x 2 (gloo): a loopback MASTER_ADDR, a port h1 rejects from h2, a name
    that does not resolve: each said once, by rank 0 for every rank, within seconds of the promise."""
    mpirun, python = openmpi
    given, words = CASES[case]
    if case == "refused":
        lab.reject("h1", "h2", 29601)
    hostfile = lab.dir / "openmpi-hosts"
    hostfile.write_text("h1 slots=2\nh2 slots=2\n")
    cmd = [mpirun, "--mca", "plm_rsh_agent", lab.enter, "--hostfile", hostfile, "--map-by", "ppr:2:node",
           "-n", "4", python, TIMED_PY]
    out, took = _timed(lab.popen("login", [str(c) for c in cmd], env(
        SPMD_BACKEND="gloo", SPMD_IFNAME="eth0", OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1,
        **given)), 180, f"Open MPI's mpirun across the lab's hosts ({case})")
    count, text = _init_error(out.stdout)
    assert out.returncode != 0 and count == 1 and _reports(text) == 1, text[-4000:]
    assert all(w in text for w in words), text[-4000:]
    if case != "name":
        assert "ranks 2, 3 on h2" in text, text[-4000:]
    assert "Traceback" not in text
    assert took is not None and took < PROMPT, f"took {took} s from the promise"


# -- plain srun (gloo, spmd's own store) ------------------------------------------------------------


@pytest.mark.parametrize("case", ["loopback", "name"])
def test_srun_errors_that_every_rank_meets_alike_are_said_once_at_once(lab, slurm, case):
    """srun -N 2 -n 3 with MASTER_ADDR=127.0.0.1 (the job spans 2 hosts) or a name that resolves nowhere:
    every rank finds it from the same setting before it waits for any other; rank 0 alone says it (no
    channel joins them yet), the others end quietly, within seconds of the promise."""
    given, words = CASES[case]
    proc = slurm.srun(["-N", "2", "-n", "3", PY, TIMED_PY], job_env(slurm, SPMD_BACKEND="gloo", **given))
    out, took = _timed(proc, 180, f"srun across the lab's hosts ({case})")
    count, text = _init_error(out.stdout)
    assert out.returncode != 0 and count == 1 and _reports(text) == 1, text[-4000:]
    assert all(w in text for w in words) and "Traceback" not in text, text[-4000:]
    if case == "loopback":
        assert "3 ranks run on 2 hosts (h1, h2)" in text and "Unset MASTER_ADDR" in text, text[-4000:]
    assert took is not None and took < PROMPT, f"took {took} s from the promise"


def test_srun_refused_port_is_named_as_a_port(lab, slurm):
    """SPMD_PORT=29601, which h1 rejects from h2: under plain srun nothing but the store joins the ranks,
    and a refusal cannot be told from a rank 0 that has not started yet, so the rank on h2 names the
    port after SPMD_TIMEOUT (20 s here), and rank 0 counts who never came (docs/reliability.md)."""
    lab.reject("h1", "h2", 29601)
    proc = slurm.srun(["-N", "2", "-n", "2", PY, TIMED_PY],
                      job_env(slurm, SPMD_BACKEND="gloo", SPMD_PORT="29601", SPMD_TIMEOUT="20"))
    out, took = _timed(proc, 180, "srun across the lab's hosts (refused)")
    text = out.stdout
    assert out.returncode != 0, text[-4000:]
    assert len(re.findall(r"h2 reached h1 \(198\.18\.0\.11\) but port 29601 refused", text)) == 1, text[-4000:]
    assert "only 1 of 2 ranks arrived within 20 s; missing ranks [1]" in text, text[-4000:]
    assert "no secret" not in text  # rank 0 gone with its secret file: still the port's words
    assert took is not None and took < 20 + PROMPT, f"took {took} s from the promise"


def test_srun_with_rank_0s_host_unable_to_resolve_its_own_name_still_runs(lab, slurm):
    """Plain srun meets at the first node's name; that host itself cannot resolve it (its /etc/hosts lacks
    it): rank 0 needs no name of its own, and serves on the interface toward srun's host."""
    lab.names("h1", own=False)
    proc = slurm.srun(["-N", "2", "-n", "3", PY, HOSTS_PY], job_env(slurm, SPMD_BACKEND="gloo"))
    out = finish(proc, 180, "srun across the lab's hosts (h1 nameless)")
    assert out.returncode == 0 and "HOSTS " in out.stdout, out.stdout[-4000:]


# -- torchrun, one agent per host ------------------------------------------------------------------


def _torchrun(lab, hosts, addr, port, script, rdzv_timeout=None, **extra):
    """One torchrun agent per host (static rendezvous at addr:port); return their outputs, together, and
    their exit statuses."""
    conf = ["--rdzv-conf", f"timeout={rdzv_timeout}"] if rdzv_timeout else []
    agents = [lab.popen(host, [TORCHRUN, "--nnodes", str(len(hosts)), "--nproc-per-node", "1", "--node-rank",
                               str(i), "--master-addr", addr, "--master-port", str(port), *conf, str(script)],
                        env(**extra))
              for i, host in enumerate(hosts)]
    outs = [finish(a, 240, f"torchrun on {h}") for a, h in zip(agents, hosts)]
    return "".join(o.stdout for o in outs), [o.returncode for o in outs]


@pytest.mark.parametrize("case", sorted(CASES))
def test_torchrun_fails_in_its_own_store_before_spmd_runs(lab, case):
    """--master-addr 127.0.0.1 across 2 hosts (each agent finds its own loopback), a master port h1
    rejects from h2, a master address that resolves nowhere: torchrun's own store fails, in its words,
    before any worker (and spmd) starts; after its rendezvous timeout (15 s here, 600 s by default)."""
    addr = {"loopback": "127.0.0.1", "refused": f"{SUBNET}.11", "name": "nosuchhost"}[case]
    if case == "refused":
        lab.reject("h1", "h2", 29517)
    text, codes = _torchrun(lab, ["h1", "h2"], addr, 29517, TIMED_PY, rdzv_timeout=15)
    assert all(c != 0 for c in codes), text[-4000:]
    assert "SPMD-PROMISE-AT" not in text and "### spmd:" not in text, text[-4000:]  # no worker started
    assert f"timed out after 15000ms while trying to connect to ({addr}, 29517)" in text, text[-4000:]
    if case == "name":
        assert "(nosuchhost, 29517) cannot be retrieved (gai error: -2 - Name or service not known)" in text
    if case == "loopback":
        assert "Timed out after 16 seconds waiting for clients. 1/2 clients joined" in text, text[-4000:]


def test_a_partition_between_two_hosts_is_named_before_gloo_waits_it_out(lab):
    """h2 and h3 drop each other's packets (both reach h1, where torchrun's store is): spmd's pair check
    names both directions of that pair, once, well before SPMD_TIMEOUT (120 s), where gloo's
    connectFullMesh would time out naming neither host.  Timed from the promise, not the launch."""
    lab.drop("h2", "h3")
    text, codes = _torchrun(lab, ["h1", "h2", "h3"], f"{SUBNET}.11", 29518, TIMED_PY, SPMD_TIMEOUT="120")
    took = since_promise(text, time.monotonic())
    assert all(c != 0 for c in codes), text[-4000:]
    assert text.count("### spmd: init failed on every rank") == 1, text[-4000:]
    assert re.search(r"h2 -> h3: 198\.18\.0\.13:\d+ \(eth0\): no answer within 5 s", text), text[-4000:]
    assert re.search(r"h3 -> h2: 198\.18\.0\.12:\d+ \(eth0\)", text) and "h1 ->" not in text, text[-4000:]
    assert took is not None and took < 60, f"took {took} s from the promise"
