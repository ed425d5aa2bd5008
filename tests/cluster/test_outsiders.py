"""An outsider on the job's network: the lab's outsider host, in no job, strikes at every port the job listens on.

A job of 2 hosts x 1 rank (tests/worlds/outsiders.py) holds its rank 1 back before init, so that rank 0
waits in init with its listeners open; then it runs collectives with compute between them until it is
let go.  In both phases the test reads, from /proc on each job host, every socket the job's processes
listen on (the ranks' own, those they inherit from the launcher, torchrun's agents'), and the outsider
(tests/worlds/stranger.py) connects to each: random bytes, the hub's words without the secret, the job
store's requests with a guessed secret, torch's own TCPStore client.  Under MPICH's mpiexec (gloo: the
job store, the hub and gloo all listen) and torchrun (c10d: torchrun's store on h1):

- the job's bytes are those of the same job without the outsider (a checksum), every rank ends, exit 0;
- spmd's listeners obey nothing: the store serves no request, the hub relays nothing and says
  nothing back; each refusal is said once on rank 0's stderr, so the outsider did reach them;
- no rank listens on a wildcard address, on any host;
- what is not spmd's to refuse is asserted as it is: torchrun's stores serve anyone, as
  docs/reliability.md, "Sockets and strangers", says; and the hub's secret is not among their keys.
"""

import ipaddress
import json
import re
import subprocess
import time
import uuid

import pytest

from tests.cluster.lab import SUBNET
from tests.cluster.runs import MPIEXEC, PY, Watched, env
from tests.support import REPO

pytestmark = pytest.mark.cluster

WORLD = str(REPO / "tests" / "worlds" / "outsiders.py")
TORCHRUN = str(REPO / ".venv" / "bin" / "torchrun")
HOSTS = ["h1", "h2"]
OUTSIDER = f"{SUBNET}.250"
REFUSALS = {"hub": f"the fail-fast hub closed a connection from {OUTSIDER}",
            "store": f"the job store closed a connection from {OUTSIDER} that did not prove it belongs to the job"}


def wildcard(host):
    return ipaddress.ip_address(host.split("%")[0]).is_unspecified


def listeners(lab, mark):
    """{host: [process, ...]} of the job's processes on each job host (tests/worlds/listening.py)."""
    found = {}
    for host in HOSTS:
        out = lab.run(host, [PY, "-m", "tests.worlds.listening", mark], timeout=30)
        assert out.returncode == 0, out.stdout[-2000:]
        found[host] = json.loads(out.stdout.strip().splitlines()[-1])
    return found


def addresses(found):
    return sorted({tuple(a) for procs in found.values() for p in procs for a in p["own"] + p["inherited"]})


def settled(lab, mark, ranks_listening, seconds=40):
    """The job's listeners once they stop changing for 2 s (at least ranks_listening ranks listening)."""
    deadline, last, since = time.monotonic() + seconds, None, time.monotonic()
    while time.monotonic() < deadline:
        now = listeners(lab, mark)
        ranks = sum(1 for procs in now.values() for p in procs if p["rank"] is not None and p["own"])
        if addresses(now) != (addresses(last) if last else None):
            last, since = now, time.monotonic()
        elif ranks >= ranks_listening and time.monotonic() - since > 2:
            return now
        time.sleep(0.3)
    pytest.fail(f"the job's listeners did not settle: {last}")


def targets(lab, found):
    """{(address, port): (whose, host, listed)} of every listener in found that the outsider can reach: whose
    is "rank" (a rank's own) or "launcher" (inherited, or torchrun's agent's), listed its address as /proc
    shows it; a wildcard is reached at the host's address, loopback not at all."""
    out = {}
    for host, procs in found.items():
        for p in procs:
            whose = "rank" if p["rank"] is not None else "launcher"
            for listed in [(a, whose) for a in p["own"]] + [(a, "launcher") for a in p["inherited"]]:
                (ip, port), who = listed
                if ipaddress.ip_address(ip.split("%")[0]).is_loopback:
                    continue
                reach = lab.host(host).address if wildcard(ip) else ip
                out.setdefault((reach, port), (who, host, [ip, port]))
    return out


def strike(lab, found, mark):
    """The outsider at every listener of found it can reach: {(address, port): what each attempt got back}."""
    out = lab.run("outsider", [PY, "-m", "tests.worlds.stranger", json.dumps(sorted(targets(lab, found))), mark],
                  timeout=120)
    line = re.search(r"^STRANGER (.*)$", out.stdout, re.M)
    assert out.returncode == 0 and line, out.stdout[-3000:]
    struck = {tuple(r["address"]): r for r in json.loads(line[1])}
    stuck = [r for r in struck.values() if not r["ended"]]
    assert not stuck, f"the outsider's attempts did not end within 60 s: {stuck}"
    return struck


def assert_nothing_obeyed(lab, found, struck, launcher):
    """No rank listens on a wildcard address; no attempt hears ABORT or BYE; the job store serves no
    request; torch's TCPStore client is served nowhere but at torchrun's own store, where it is (it has
    no authentication: docs/reliability.md says so, and this says when that changes)."""
    for host, procs in found.items():
        for p in procs:
            if p["rank"] is not None:
                wide = [a for a in p["own"] + p["inherited"] if wildcard(a[0])]
                assert not wide, f"{launcher}: rank {p['rank']} on {host} listens on every interface: {wide}"
    whose = targets(lab, found)
    assert set(struck) == set(whose), (sorted(struck), sorted(whose))
    served = set()
    for address, got in struck.items():
        for attempt in ("garbage", "hub hello", "bare words", "long line"):
            assert "ABORT" not in got[attempt]["reply"] and "BYE" not in got[attempt]["reply"], (address, got)
        assert not got.get("store"), f"{launcher}: the job store served an outsider at {address}: {got['store']}"
        if got["torch client"].get("set"):
            served.add(address)
            assert whose[address][0] == "launcher" and launcher == "torchrun", \
                f"{launcher}: torch's TCPStore client was served at {address} ({whose[address]}): {got}"
    if launcher == "torchrun":  # the agent's stores on h1, on every interface: anyone's to read and write
        assert served and all(struck[a]["torch client"]["get"] for a in served), struck
        assert all(whose[a][1] == "h1" and wildcard(whose[a][2][0]) for a in served), [whose[a] for a in served]
    return [struck[a]["torch client"].get("hub invitation") for a in served]


def job_output_says(text, launcher):
    assert text.count("DONE rank") == 2, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    reports = [line for line in text.splitlines() if line.startswith("### spmd:")]
    assert all("(reported once; the job goes on)" in line for line in reports), reports
    assert REFUSALS["hub"] in text, f"{launcher}: the outsider never reached the hub:\n{text[-4000:]}"
    if launcher == "mpiexec":
        assert REFUSALS["store"] in text, f"the outsider never reached the job store:\n{text[-4000:]}"


def checksum(text):
    found = re.search(r"^CHECKSUM (\w+) rounds (\d+)$", text, re.M)
    assert found, text[-4000:]
    return found[1]


def start(lab, launcher, flags, mark, port=29560):
    """The job, under launcher, as Watched outputs (mpiexec's alone; torchrun's agents on h1 and h2)."""
    job_env = env(SPMD_BACKEND="gloo", SPMD_OUTSIDER_MARK=mark)
    if launcher == "mpiexec":
        cmd = lab.mpiexec_args(MPIEXEC, ["-n", "2", "-ppn", "1", PY, WORLD, flags], HOSTS)
        return [Watched(lab.popen("login", cmd, job_env))]
    return [Watched(lab.popen(host, [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                     "--rdzv-endpoint", f"{SUBNET}.11:{port}", "--rdzv-id", mark,
                                     *(["--rdzv-conf", "is_host=1"] if host == "h1" else []), WORLD, flags],
                            job_env)) for host in HOSTS]


def ended(jobs, seconds):
    """Wait for every process of jobs (killing them all after seconds); return their output, together,
    and their exit statuses."""
    deadline = time.monotonic() + seconds
    try:
        for job in jobs:
            job.proc.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for job in jobs:
            job.kill()
        pytest.fail(f"the job hung: no exit within {seconds} s:\n" + "".join(j.drain(1) for j in jobs)[-4000:])
    return "".join(job.drain(5) for job in jobs), [job.proc.returncode for job in jobs]


@pytest.fixture(scope="module")
def alone(cluster_lab, tmp_path_factory):
    """The checksum of the job with no outsider (both flags made beforehand: nothing waits)."""
    cluster_lab.reset()
    flags = tmp_path_factory.mktemp("alone")
    (flags / "init").touch()
    (flags / "run").touch()
    jobs = start(cluster_lab, "mpiexec", str(flags), f"alone-{uuid.uuid4().hex[:8]}")
    text, codes = ended(jobs, 150)
    assert codes == [0], text[-4000:]
    return checksum(text)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_an_outsider_at_every_port_in_init_and_in_the_run_changes_nothing(lab, alone, tmp_path, launcher):
    mark = f"outsider-{uuid.uuid4().hex[:12]}"
    jobs = start(lab, launcher, str(tmp_path), mark)
    seen = {}
    try:
        deadline = time.monotonic() + 120
        while not any("HELD" in job.drain(0.2) for job in jobs):
            assert time.monotonic() < deadline and all(j.proc.poll() is None for j in jobs), \
                "".join(j.text() for j in jobs)[-4000:]
        seen["init"] = settled(lab, mark, 0)
        print("LISTENERS init", json.dumps(seen["init"]))
        struck_init = strike(lab, seen["init"], mark)
        assert all(j.proc.poll() is None for j in jobs), "the job ended in init"
        (tmp_path / "init").touch()
        deadline = time.monotonic() + 120
        while "".join(j.drain(0.2) for j in jobs).count("RUNNING rank") < 2:
            assert time.monotonic() < deadline, "".join(j.text() for j in jobs)[-4000:]
        seen["run"] = settled(lab, mark, 2)
        print("LISTENERS run", json.dumps(seen["run"]))
        struck_run = strike(lab, seen["run"], mark)
        assert all(j.proc.poll() is None for j in jobs), "a rank ended while the outsider struck"
        (tmp_path / "run").touch()
    except BaseException:
        for job in jobs:
            job.kill()
        raise
    text, codes = ended(jobs, 150)
    print("STRUCK", json.dumps({"init": list(struck_init.values()), "run": list(struck_run.values())}))
    assert codes == [0] * len(jobs), text[-4000:]
    assert checksum(text) == alone
    job_output_says(text, launcher)
    assert_nothing_obeyed(lab, seen["init"], struck_init, launcher)
    leaked = assert_nothing_obeyed(lab, seen["run"], struck_run, launcher)
    assert not any(leaked), f"{launcher}: the hub's secret is in a store the outsider reads: {leaked}"
