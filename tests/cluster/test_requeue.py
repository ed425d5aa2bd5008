"""A job that loses a host heals under bin/submit's requeue: SLURM requeues it, and it resumes on the hosts left.

``bin/submit --nodes 2-3 --ntasks-per-node 1 --requeue`` submits the main job with ``--resume`` to the lab's
SLURM (slurmctld on the login host, a slurmd on each of h1..h3); SLURM gives it all three nodes.  Once its
journal holds a tenth of the rounds, every process of h3 is SIGKILLed, slurmd and slurmstepd included
(lab.kill_all).  spmd's hub ends the ranks on h1 and h2 at once (status 75, the report naming h3), but the
step cannot end without h3's slurmstepd: srun waits until slurmctld finds h3 silent for SlurmdTimeout, sets
it DOWN, and requeues the job (NODE_FAIL, --requeue); the requeued job waits cred_expire, starts on the two
nodes left (the node range), and continues at 2 ranks from its journal: the output ends with the checksum
and the bytes of an uninterrupted run (tests/cluster/healing.py).  SLURM's defaults (SlurmdTimeout 300 s,
cred_expire 120 s) would make this a 7-minute test; the lab's SLURM sets 5 and 5, and the test bounds the
time from the kill to the job's end.
"""

from __future__ import annotations

import datetime
import os
import re
import time

import pytest

from spmd.pipeline.journal import journal_path
from spmd.pipeline.sinks import partial_path
from tests.cluster.healing import JOB, ROWS, TIMEOUT, checksum, journaled, no_job_left, reference, sha256
from tests.cluster.runs import PY
from tests.cluster.slurm import LabSlurm, job_env
from tests.cluster.test_hosts import loopback_names
from tests.submit.slurm_cluster import SlurmUnavailable
from tests.support import REPO, finish, missing

pytestmark = pytest.mark.cluster

SUBMIT = REPO / "bin" / "submit"
# s from the kill to the job's end; measured about 55: h3 DOWN after ~25 (slurmctld pings a node every
# SlurmdTimeout/3 s, then waits SlurmdTimeout), the step's end ~10 (KillWait 5), the requeue's wait ~13, the run ~5
REQUEUE_BOUND = 150


@pytest.fixture
def quick_slurm(lab):
    """SLURM on the lab's hosts that finds a dead node and starts a requeued job within seconds."""
    try:
        cluster = LabSlurm.start_on(lab, quick_requeue=True)
    except SlurmUnavailable as exc:
        missing(f"no SLURM on the private cluster: {exc}")
    yield cluster
    cluster.stop()


def ctld_log(slurm):
    return (slurm.root / "log" / "slurmctld.log").read_text()


def phases(slurm, job_id, killed_at):
    """Seconds from the kill (wall clock) to what slurmctld logged: h3 DOWN, the job requeued, started again."""
    marks = {"h3 DOWN": r"Nodes h3 not responding, setting DOWN", "requeued": rf"Requeuing JobId={job_id}\b",
             "started on h[1-2]": rf"sched: Allocate JobId={job_id} NodeList=h\[1-2\]"}
    text = ctld_log(slurm)
    out = {}
    for name, pattern in marks.items():
        found = re.search(rf"^\[([\d-]+T[\d:.]+)\] .*{pattern}", text, re.M)
        if found:
            out[name] = datetime.datetime.fromisoformat(found[1]).timestamp() - killed_at
    return ", ".join(f"{name} {seconds:.0f}" for name, seconds in out.items())


def submit(lab, slurm, where, out):
    """bin/submit --wait from the login host, as a user would; return the Popen and the job id."""
    cmd = [SUBMIT, "--wait", "--tail", "0", "--nodes", "2-3", "--ntasks-per-node", 1, "--requeue", "-t", 10,
           "-o", where / "job-%j.out", "--save-dir", where / "submit", *JOB, "--output", out, "--resume"]
    proc = lab.popen("login", [str(c) for c in cmd], job_env(slurm, SPMD_PYTHON=PY, SPMD_BACKEND="gloo"),
                     cwd=where)
    said = []  # its notes and sbatch's verdict (stderr) come first, then the job id alone on a line
    while not (said and said[-1].strip().isdigit()):
        line = proc.stdout.readline()
        if not line:
            pytest.fail("bin/submit printed no job id:\n" + "".join(said)[-3000:])
        said.append(line)
    return proc, said[-1].strip()


@pytest.mark.timeout(TIMEOUT + 180)
def test_a_job_that_loses_a_host_is_requeued_and_resumes_on_the_hosts_left(lab, quick_slurm, tmp_path):
    loopback_names(lab)
    want = reference(lab, tmp_path)
    out = tmp_path / "out.npy"
    proc, job_id = submit(lab, quick_slurm, tmp_path, out)
    deadline = time.monotonic() + TIMEOUT
    while not journaled(out):
        if time.monotonic() > deadline or proc.poll() is not None:
            log = next(tmp_path.glob("job-*.out"), None)
            pytest.fail(f"no tenth of the rounds journaled within {TIMEOUT} s: "
                        f"{finish(proc, 30, 'bin/submit').stdout[-2000:]}\n{log.read_text()[-3000:] if log else ''}")
        time.sleep(0.05)
    lab.kill_all("h3")
    killed, killed_at = time.monotonic(), time.time()
    done = finish(proc, TIMEOUT, "bin/submit --wait")
    healed = time.monotonic() - killed
    log = (tmp_path / f"job-{job_id}.out").read_text()
    assert done.returncode == 0 and f"job {job_id} COMPLETED, exit code 0:0" in done.stdout, (done.stdout, log)
    # the first run: three nodes, ended by spmd once h3's rank was gone, then requeued by SLURM for h3's failure
    first, _, second = log.partition("spmd: 2 nodes (h[1-2]), 2 tasks, requeue number 1\n")
    assert first.startswith("spmd: 3 nodes (h[1-3]), 3 tasks\n") and second, log
    assert "rank 2 of 3 on h3 died without reporting an error" in first, log
    assert re.search(rf"requeue job JobId={job_id} due to failure of node h3$", ctld_log(quick_slurm), re.M), \
        ctld_log(quick_slurm)[-3000:]
    # the requeued run: two ranks, from the journal, to the bytes of an uninterrupted run
    resumed = re.search(r"resumed at row (\d+) \((\d+) rounds done before\)", second)
    assert resumed and 0 < int(resumed[1]) < ROWS, log
    assert "2 ranks, backend gloo" in second and (checksum(second), sha256(out)) == want, log
    assert not partial_path(out).exists() and not os.path.exists(journal_path(out))
    job = quick_slurm.run(["scontrol", "show", "job", job_id]).stdout
    assert re.search(r"\bRestarts=1\b", job) and re.search(r"\bNodeList=h\[1-2\]", job), job
    no_job_left(lab, ["h1", "h2"], "scatter_gather")
    assert healed < REQUEUE_BOUND, (healed, log)
    print(f"requeued: {healed:.1f} s from the kill to the job's end ({phases(quick_slurm, job_id, killed_at)} s), "
          f"1 requeue, resumed at row {resumed[1]}")
