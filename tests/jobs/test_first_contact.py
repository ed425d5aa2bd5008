"""The first ten minutes, tried as a newcomer would: each mistake gives one true message with its fix.

Launcher tier: a bad option under every launcher (said once, the job
exits 2), the input and output mistakes of the main job under mpirun (said
once, before any compute), and the line that says a host has more ranks
than CPUs (pinned to one CPU with taskset, so it holds on any machine).
"""

import re
import shutil

import numpy as np
import pytest

from tests.support import MPIRUN, PY, REPO, clean_env, run, tool

pytestmark = pytest.mark.launcher

JOB = str(REPO / "jobs" / "scatter_gather.py")
SPMD = tool("spmd")
LAUNCHERS = {
    "mpirun": [MPIRUN, "-n", "3", PY],
    "mpirun-python-m-spmd": [MPIRUN, "-n", "3", PY, "-m", "spmd"],
    "spmd-run": [SPMD, "run", "-n", "3"],
    "torchrun": [PY, "-m", "torch.distributed.run", "--nproc-per-node", "3"],
    "python": [PY],
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_a_bad_option_is_said_once_and_the_job_exits_2(launcher):
    result = run(LAUNCHERS[launcher] + [JOB, "--bogus"], 100, env=clean_env())
    out = result.stdout
    assert out.count("No such option '--bogus'") == 1, out[-3000:]
    assert out.count("Usage: scatter_gather.py") == 1 and "scatter_gather.py\", line" not in out, out[-3000:]
    assert "### spmd" not in out, out[-3000:]  # no failure report: nothing failed but the command line
    if launcher == "torchrun":  # the agent itself raises and exits 1, after listing its ranks' statuses
        assert len(re.findall(r"exitcode\s*:\s*2", out)) >= 1 and result.returncode == 1, out[-3000:]
    else:
        assert result.returncode == 2 and "Traceback" not in out, out[-3000:]


LATE_RANK_0 = """
import os, time
import click
from spmd import run_command

@click.command()
def main():
    pass

if (os.environ.get("RANK") or os.environ.get("PMI_RANK")) == "0":
    time.sleep(3)  # rank 0 starts late, as on a loaded machine
run_command(main)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_the_message_is_said_even_when_rank_0_comes_last(launcher, tmp_path):
    # torchrun ends a job at its first failing rank: a quiet rank that exited 2 first had it end rank 0
    # before rank 0 printed the error (seen in a clean-clone run); the quiet ranks now exit 0.
    script = tmp_path / "late.py"
    script.write_text(LATE_RANK_0)
    result = run(LAUNCHERS[launcher] + [script, "--bogus"], 100, env=clean_env())
    assert result.stdout.count("No such option '--bogus'") == 1, result.stdout[-3000:]
    assert result.returncode == (1 if launcher == "torchrun" else 2), result.stdout[-3000:]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    work = tmp_path_factory.mktemp("first")
    np.save(work / "in.npy", np.arange(64_000, dtype=np.float32).reshape(4000, 16))
    (work / "trunc.npy").write_bytes((work / "in.npy").read_bytes()[:100_000])
    (work / "text.npy").write_text("a,b\n1,2\n")
    (work / "ragged.csv").write_text("1,2,3\n4,5,6\n7,8\n")
    return work


CASES = {
    "truncated": (["--input", "trunc.npy"], r"trunc\.npy: the file is shorter than its header says: 100,000 bytes, "
                  r"but its 4000x16 float32 array needs 256,128: was it copied completely\?"),
    "not npy": (["--input", "text.npy"], r"text\.npy: not a \.npy file .*write it with numpy\.save"),
    "ragged csv": (["--input", "ragged.csv"], r"ragged\.csv: line 3 has 2 comma-separated values but line 1 has 3"),
    "no directory": (["--input", "in.npy", "--output", "{work}/nowhere/o.npy"],
                     r"output \S+/nowhere/o\.npy: the directory \S+/nowhere does not exist; create it "
                     r"\(mkdir -p \S+/nowhere\)"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_an_input_or_output_mistake_is_said_once_before_any_compute(inputs, case):
    args, pattern = CASES[case]
    args = [a.format(work=inputs) if "{" in a else (str(inputs / a) if a.endswith((".npy", ".csv")) else a)
            for a in args]
    result = run([MPIRUN, "-n", "2", PY, JOB, *args], 100, env=clean_env(SPMD_BACKEND="gloo"))
    out = result.stdout
    assert result.returncode == 1, out[-3000:]
    assert len(re.findall(pattern, out)) == 1, f"{case}: wanted once: {pattern}\n{out[-3000:]}"
    assert "rows in" not in out and "spmd-tmp" not in out and "Traceback" not in out, out[-3000:]
    assert not list(inputs.glob("nowhere")), "the missing directory was made"


@pytest.mark.timeout(150)
@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset (util-linux) not found")
def test_more_ranks_than_cpus_is_said_once_at_start_and_the_summary_splits_start_up_from_work():
    pinned = ["taskset", "-c", "0", MPIRUN, "-n", "2", PY, JOB, "--rows", "2000"]
    result = run(pinned, 120, env=clean_env(SPMD_HINTS="1", SPMD_BACKEND="gloo"))
    out = result.stdout
    assert result.returncode == 0, out[-3000:]
    hint = "spmd: 2 ranks share this host's 1 CPU and take turns"
    assert out.count(hint) == 1 and "`spmd run --preload torch -n 2` starts faster" in out, out[-3000:]
    assert out.index(hint) < out.index("rows in"), out[-3000:]  # at start, before the job's report
    assert re.search(r"start-up \d+\.\d+ s \(the slowest rank's python, import torch and spmd\.init\); "
                     r"input and task ready in \d+\.\d+ s", out), out[-3000:]
    alone = run(["taskset", "-c", "0", MPIRUN, "-n", "1", PY, JOB, "--rows", "2000"], 120,
                env=clean_env(SPMD_HINTS="1"))
    assert alone.returncode == 0 and "ranks share this host" not in alone.stdout, alone.stdout[-3000:]
