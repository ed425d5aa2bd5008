"""A job that loses a host heals on the hosts left: torchrun's elastic restart across the lab's hosts.

One torchrun agent per host (h1, h2, h3; c10d's rendezvous at h1, ``--nnodes 2:3 --max-restarts 1``)
runs the main job with ``--resume``, its output on the file system the lab's hosts share.  Once its
journal holds a tenth of the rounds, every process of h3 is SIGKILLed, its agent included
(lab.kill_all).  spmd's hub ends the ranks on h1 and h2 (status 75), their agents restart them in a
rendezvous of the two nodes left, and the job continues at 2 ranks from its journal: the output ends
with the checksum and the bytes of an uninterrupted run (MPICH's mpiexec over h1 and h2, computed
once for the session: tests/cluster/healing.py).  Then the same for training: jobs/train_dp.py resumes
from its checkpoint.  With torch's defaults the two agents wait about 45 s for the dead node (its 30 s of last call, and
15 s until a dead node's heartbeat expires): RDZV_CONF are the settings that docs/reliability.md
("Healing across hosts") tells a user to set, and the pipeline's bound tells them apart.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time

import pytest
import torch

from spmd.pipeline.journal import journal_path
from spmd.pipeline.sinks import partial_path
from tests.cluster.healing import JOB, ROWS, TIMEOUT, checksum, journaled, no_job_left, reference, sha256
from tests.cluster.lab import SUBNET
from tests.cluster.runs import PY, env, mpiexec
from tests.cluster.test_hosts import loopback_names
from tests.support import REPO, finish

pytestmark = pytest.mark.cluster

TORCHRUN = str(REPO / ".venv" / "bin" / "torchrun")
# The rendezvous of the nodes left closes last_call_timeout after they met (torch: 30 s, most of the
# wait); a dead node's heartbeat expires after keep_alive_interval x keep_alive_max_attempt s (torch: 5 x 3).
RDZV_CONF = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"
HEAL_BOUND = 30  # s from the kill to the job's end, less the restarted ranks' start-up; torch's defaults: 50+
TRAIN = [REPO / "jobs" / "train_dp.py", "--steps", 40, "--global-batch", 48, "--log-every", 0]
# fp32 sums in another order (2 ranks' instead of 3's; measured after 40 steps: 3.1e-7 at most, 4.5e-7 of
# the distance trained); a wrongly scaled or missing gradient is off by 1e-2 (tests/train/test_data_parallel.py)
FP32_ABS, FP32_REL = 1e-5, 1e-4


def agents(lab, run_id, port, job):
    """Start one torchrun agent per compute host, elastic over 2 to 3 nodes, one restart allowed."""
    return {host: lab.popen(host, [str(c) for c in [
        TORCHRUN, "--nnodes", "2:3", "--nproc-per-node", 1, "--max-restarts", 1, "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{SUBNET}.11:{port}", "--rdzv-id", run_id,
        "--rdzv-conf", RDZV_CONF + (",is_host=1" if host == "h1" else ""), *job]], env(SPMD_BACKEND="gloo"))
        for host in ("h1", "h2", "h3")}


def wait_for(predicate, timeout, what, procs):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
            outs = {h: finish(p, 1, f"torchrun on {h}").stdout if p.poll() is not None else "(running)"
                    for h, p in procs.items()}
            for p in procs.values():
                if p.poll() is None:
                    os.killpg(p.pid, 9)
            pytest.fail(f"no {what} within {timeout} s: " + "\n".join(f"== {h}\n{o[-2000:]}" for h, o in outs.items()))
        time.sleep(0.05)


@pytest.mark.timeout(TIMEOUT + 120)
def test_torchrun_heals_the_pipeline_on_the_hosts_left_with_the_same_bytes(lab, tmp_path):
    loopback_names(lab)
    want = reference(lab, tmp_path)
    out = tmp_path / "out.npy"
    journal = journal_path(out)
    procs = agents(lab, "heal-pipeline", 29540, [*JOB, "--output", out, "--resume"])
    wait_for(lambda: journaled(out), TIMEOUT, "tenth of the rounds journaled", procs)
    lab.kill_all("h3")
    killed = time.monotonic()
    done = {h: finish(procs[h], TIMEOUT, f"torchrun on {h}") for h in ("h1", "h2")}
    healed = time.monotonic() - killed
    h3 = finish(procs["h3"], 30, "torchrun on h3")
    outs = {h: d.stdout for h, d in done.items()}
    both = "\n".join(f"== {h}\n{o[-3000:]}" for h, o in outs.items())
    assert [d.returncode for d in done.values()] == [0, 0] and h3.returncode != 0, (h3.returncode, both)
    # the first attempt ran on 3 ranks and spmd ended it once h3's rank was gone; torchrun says it
    assert "rank 2 of 3 on h3 died without reporting an error" in both, both
    assert both.count("failed (exitcode: 75)") == 2, both
    final = [o for o in outs.values() if "wrote " in o]
    assert len(final) == 1, both
    resumed = re.search(r"resumed at row (\d+) \((\d+) rounds done before\)", final[0])
    assert resumed and 0 < int(resumed[1]) < ROWS, both
    assert "2 ranks, backend gloo" in final[0], both
    assert (checksum(final[0]), sha256(out)) == want
    assert not partial_path(out).exists() and not os.path.exists(journal)
    no_job_left(lab, ["h1", "h2"], "scatter_gather")
    startup = float(re.search(r"start-up ([\d.]+) s", final[0])[1])
    assert healed - startup < HEAL_BOUND, (healed, startup, both)
    print(f"healed: {healed:.1f} s from the kill to the job's end (the restarted ranks' start-up {startup:.1f} s)")


def digest(out, ranks):
    found = re.findall(rf"parameters identical on {ranks} ranks \(sha256 (\w+)\)", out)
    assert len(found) == 1, out[-4000:]
    return found[0]


def initial_model():
    """jobs/train_dp.py's model before training (seed 0)."""
    spec = importlib.util.spec_from_file_location("train_dp", TRAIN[0])
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    return job.build_model(0)


def flat(path):
    return torch.cat([t.reshape(-1).double() for t in torch.load(path).values()])


@pytest.mark.timeout(3 * TIMEOUT + 120)
def test_torchrun_heals_training_from_its_checkpoint(lab, tmp_path):
    """train_dp with a checkpoint every 2 steps (a fixed path: a restarted attempt resumes from it); h3
    dies once the first is written.  The healed job trains on at 2 ranks from that step: its parameters
    are the bytes of 3 ranks to that step and then 2 from the checkpoint (mpiexec, no fault), and within
    fp32 summation order of an uninterrupted run at 3 ranks (the global batch is the same at every world
    size; its sums are split otherwise)."""
    loopback_names(lab)
    ck, at_kill = tmp_path / "ck.pt", tmp_path / "ck-at-kill.pt"
    healed, resumed, uninterrupted = (tmp_path / f"{n}.pt" for n in ("healed", "resumed", "uninterrupted"))
    procs = agents(lab, "heal-train", 29541, [*TRAIN, "--checkpoint", ck, "--checkpoint-every", 2,
                                              "--save-final", healed])
    wait_for(ck.exists, TIMEOUT, "first checkpoint", procs)
    lab.kill_all("h3")
    time.sleep(1)  # the ranks on h1 and h2 end within a second; the restart waits 3 s of last call at least
    at_kill.write_bytes(ck.read_bytes())
    done = {h: finish(procs[h], TIMEOUT, f"torchrun on {h}") for h in ("h1", "h2")}
    finish(procs["h3"], 30, "torchrun on h3")
    both = "\n".join(f"== {h}\n{d.stdout[-3000:]}" for h, d in done.items())
    assert [d.returncode for d in done.values()] == [0, 0], both
    assert "rank 2 of 3 on h3 died without reporting an error" in both and both.count("failed (exitcode: 75)") == 2, both
    final = [d.stdout for d in done.values() if "parameters identical on" in d.stdout]
    assert len(final) == 1, both
    step = re.search(r"train_dp: 2 ranks \(gloo\).*; resuming at step (\d+)", final[0])
    assert step and 0 < int(step[1]) < 40 and torch.load(at_kill)["step"] == int(step[1]), both
    no_job_left(lab, ["h1", "h2"], "train_dp")
    again = mpiexec(lab, ["-n", 2, "-ppn", 1, PY, *TRAIN, "--resume", at_kill, "--save-final", resumed],
                    ["h1", "h2"], TIMEOUT, SPMD_BACKEND="gloo")
    assert again.returncode == 0, again.stdout[-4000:]
    assert digest(final[0], 2) == digest(again.stdout, 2)
    a, b = torch.load(healed), torch.load(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    whole = mpiexec(lab, ["-n", 3, "-ppn", 1, PY, *TRAIN, "--save-final", uninterrupted], None, TIMEOUT,
                    SPMD_BACKEND="gloo")
    assert whole.returncode == 0, whole.stdout[-4000:]
    got, ref = flat(healed), flat(uninterrupted)
    start = torch.cat([t.reshape(-1).double() for t in initial_model().state_dict().values()])
    worst, rel = (got - ref).abs().max().item(), ((got - ref).norm() / (ref - start).norm()).item()
    print(f"healed training: resumed at step {step[1]}; against an uninterrupted run: max {worst:.2g}, "
          f"relative {rel:.2g}, bytes {'equal' if digest(whole.stdout, 3) == digest(final[0], 2) else 'differ'}")
    assert worst < FP32_ABS and rel < FP32_REL, (worst, rel)
