"""A straggler host: one host of three runs at a third of its speed, the job ends right, and the trace names it."""

import json
import subprocess
import threading
import time

import pytest

from tests.cluster.runs import MPIEXEC, Watched, env
from tests.support import PY, REPO

pytestmark = pytest.mark.cluster

STEPS = 30


def _slowed(lab, host, stop):
    """Freeze every process of host for 100 ms, thaw it for 50, until stop is set (then thaw)."""
    try:
        while not stop.is_set():
            lab.freeze(host, True)
            time.sleep(0.10)
            lab.freeze(host, False)
            time.sleep(0.05)
    finally:
        lab.freeze(host, False)


def test_a_straggler_host_is_named_by_the_summary_and_the_trace(lab, tmp_path):
    path = tmp_path / "trace.json"
    cmd = lab.mpiexec_args(MPIEXEC, [str(PY), str(REPO / "tests" / "worlds" / "steps.py")])
    job = Watched(lab.popen("login", cmd, env(SPMD_BACKEND="gloo", SPMD_TRACE=str(path), STEPS=str(STEPS),
                                              PRODUCTS="120", OMP_NUM_THREADS="1")))
    job.wait_for(r"^STEPS start", count=3, timeout=120)
    stop = threading.Event()
    slower = threading.Thread(target=_slowed, args=(lab, "h3", stop), daemon=True)
    slower.start()
    try:
        job.wait_for(r"^STEPS sum", count=3, timeout=180)
    finally:
        stop.set()
        slower.join(10)
    job.wait_for(r"^trace written to", timeout=60)
    try:
        code = job.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail(f"the steps job did not end within 60 s of its trace:\n{job.text()[-4000:]}")
    out = job.drain(5)
    assert code == 0, out[-4000:]
    expected = sum(6.0 + 3 * step for step in range(STEPS))  # ranks add 1, 2, 3, each plus the step
    assert out.count(f"STEPS sum {expected:g}") == 3, out[-4000:]
    # the summary names h3 and its rank first: the others waited for it far longer than for anyone else
    said = [x for x in out.splitlines() if "waited most for" in x or x.startswith("  then ")]
    assert said and "waited most for h3 (rank 2): last to arrive in" in said[0], out[-4000:]
    waited = [float(x.split(", ")[-1].split(" rank-seconds")[0]) for x in said]
    assert len(said) == 1 or waited[0] > 2 * waited[1], said
    calls = int(said[0].split(" calls")[0].split(" of ")[-1])
    assert calls == STEPS, said  # every all_reduce, every rank's
    # the Chrome trace names each process by its host, and each all_reduce by who came last: most often h3's
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {0: "rank 0 (h1)", 1: "rank 1 (h2)", 2: "rank 2 (h3)"}, names
    lasts = [e["args"]["last_rank"] for e in events if e["ph"] == "X" and e["pid"] == 0 and e["name"] == "all_reduce"]
    assert len(lasts) == STEPS and max({0, 1, 2}, key=lasts.count) == 2, lasts
