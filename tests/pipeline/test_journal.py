"""spmd.pipeline.journal: the journal file, and resuming from it after a failure, a preemption or SIGKILL."""

import json
import os
import time
import uuid

import numpy as np
import pytest

from spmd.errors import PipelineError, PipelineJournalError, PipelinePreempted, PipelineValueError
from spmd.pipeline import checksum
from spmd.pipeline import journal
from spmd.pipeline.run import SyntheticTable, pipeline
from spmd.pipeline.sinks import partial_path
from spmd.runtime import preempt

from tests.support import MPIRUN, PY, REPO, WORLDS, clean_env, finish, left_behind, run, start, tool


@pytest.mark.unit
def test_journal_ignores_a_torn_last_line_and_refuses_a_gap(tmp_path):
    out = tmp_path / "out.npy"
    j = journal.Journal(out)
    j.start({"rows": 10, "task": "t"})
    j.add(0, 4, 1, 2)
    j.add(4, 8, 3, 4)
    j.close()
    with open(j.path, "ab") as f:
        f.write(b'{"rows":[8,1')  # killed while appending
    loaded = journal.Journal(out).load()
    assert loaded.done == 8 and len(loaded.rounds) == 2 and loaded.header["task"] == "t"
    loaded.reopen()
    loaded.add(8, 10, 5, 6)
    loaded.close()
    assert [json.loads(line)["rows"] for line in open(j.path).read().splitlines()[1:]] == [[0, 4], [4, 8], [8, 10]]
    lines = open(j.path).read().splitlines()
    open(j.path, "w").write("\n".join([lines[0], lines[2]]) + "\n")
    with pytest.raises(PipelineError, match=r"round \[4, 8\] does not follow row 0"):
        journal.Journal(out).load()
    assert journal.differences({"task": "a", "rows": 1}, {"task": "b", "rows": 1}) == [
        "task: the journal has 'a', this run 'b'"]


def _double(block):
    return block * np.float32(2)


@pytest.mark.unit
def test_resume_continues_after_a_failure_and_refuses_what_does_not_match(tmp_path):
    src = SyntheticTable(2000, 3, seed=4)
    want = src.read(0, 2000) * 2
    out = tmp_path / "out.npy"
    seen = []

    def fails_in_round_3(block):
        seen.append(block.shape[0])
        if len(seen) == 3:
            raise RuntimeError("power cut")
        return _double(block)

    with pytest.raises(PipelineError, match="power cut"):
        pipeline(fails_in_round_3, src, output=out, chunk_rows=300, resume=True, task="double")
    assert not out.exists() and partial_path(out).exists() and os.path.exists(journal.journal_path(out))
    with pytest.raises(PipelineJournalError, match=r"holds 2 finished rounds \(600 of 2000 rows\).*resume=True"):
        pipeline(_double, src, output=out, chunk_rows=300, task="double")
    with pytest.raises(PipelineJournalError, match="input: the journal has '<SyntheticTable 2000 x 3, seed 4>"):
        pipeline(_double, SyntheticTable(2000, 3, seed=5), output=out, resume=True, task="double")
    with pytest.raises(PipelineValueError, match="resume=True needs output to be a file path"):
        pipeline(_double, src, resume=True)
    read = []

    class Counted(SyntheticTable):
        def read(self, a, b):
            read.append((a, b))
            return super().read(a, b)

    r = pipeline(_double, Counted(2000, 3, seed=4), output=out, chunk_rows=500, resume=True, task="double")
    assert np.array_equal(np.load(out), want) and r.checksum == checksum.get().of(want)
    assert (r.resumed_rows, r.resumed_rounds, r.rows_processed) == (600, 2, 1400)
    assert read == [(600, 1100), (1100, 1600), (1600, 2000)]  # only the unfinished rows, read once
    assert r.input_checksum == checksum.get().of(src.read(0, 2000))
    assert not partial_path(out).exists() and not os.path.exists(journal.journal_path(out))


@pytest.mark.unit
def test_a_preemption_signal_ends_a_resumable_run_at_a_round_and_resume_finishes_it(tmp_path):
    src = SyntheticTable(1000, 2, seed=1)
    out = tmp_path / "out.npy"
    calls = []

    def signalled_in_round_2(block):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), preempt.signal_number())
        return _double(block)

    preempt.install()
    try:
        with pytest.raises(PipelinePreempted, match="preempted after row 400 of 1000.*--resume"):
            pipeline(signalled_in_round_2, src, output=out, chunk_rows=200, resume=True, task="d")
    finally:
        preempt.reset()
    r = pipeline(_double, src, output=out, chunk_rows=200, resume=True, task="d")
    assert r.resumed_rows == 400 and np.array_equal(np.load(out), src.read(0, 1000) * 2)


ROWS, CHUNK = 36_000, 1000  # 36 rounds of about 50 ms each


def reference():
    return SyntheticTable(ROWS, 4, seed=7).read(0, ROWS) * np.float32(2)


def kill_halfway(cmd, env, out, what):
    """Start a resumable run, SIGKILL every process of it once half its rounds are journaled."""
    mark = f"spmd-resume-{uuid.uuid4().hex[:12]}"
    env = dict(env, SPMD_RESUME_MARK=mark)
    proc = start(cmd, env)
    path, deadline = journal.journal_path(out), time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        try:  # the rows of the rounds journaled (a Zarr output's rounds are its chunks, not CHUNK rows)
            done = sum(b - a for a, b in (json.loads(line)["rows"] for line in open(path).read().splitlines()[1:]
                                          if line.endswith("}")))
        except FileNotFoundError:
            done = 0
        if done >= ROWS // 2:
            break
        time.sleep(0.01)
    else:
        proc.kill()
        pytest.fail(f"{what}: the journal never held half the rows:\n{finish(proc, 30).stdout[-3000:]}")
    victims = left_behind(mark, grace=0)  # SIGKILLs every process of the run, now
    result = finish(proc, 30, what)
    assert not left_behind(mark), what
    assert result.returncode != 0 and victims, (result.returncode, victims)
    assert not out.exists() and partial_path(out).exists(), result.stdout[-3000:]
    return result


def two_sizes(launcher):
    """(the first run's command, the resumed run's at another size, their environment) under launcher."""
    if launcher == "mpirun":
        return [MPIRUN, "-n", 2, PY], [MPIRUN, "-n", 3, PY], clean_env(SPMD_BACKEND="mpi")
    spmd = tool("spmd")
    return [spmd, "run", "-n", 3], [spmd, "run", "-n", 2], clean_env()


def check_resumed(result, out):
    import re

    assert result.returncode == 0, result.stdout[-4000:]
    m = re.search(r"RESUMED (\d+) ROUNDS (\d+) PROCESSED (\d+) READ (\d+) MODE (\S+)", result.stdout)
    assert m, result.stdout[-3000:]
    resumed, rounds, processed, read = (int(g) for g in m.groups()[:4])
    assert resumed >= ROWS // 2 and rounds >= ROWS // CHUNK // 2, result.stdout[-2000:]
    assert processed == ROWS - resumed and read == ROWS - resumed, result.stdout[-2000:]  # counted
    got = np.load(out)
    assert got.shape == (ROWS, 4) and np.array_equal(got, reference())
    assert not partial_path(out).exists() and not os.path.exists(journal.journal_path(out))


@pytest.mark.launcher
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["mpirun", "spmd-run"])
def test_a_run_killed_halfway_resumes_at_another_size_with_the_same_bytes(tmp_path, launcher):
    out = tmp_path / "out.npy"
    script = [WORLDS / "resumable.py", out, ROWS, CHUNK]
    first, second, env = two_sizes(launcher)
    kill_halfway(first + script, env, out, f"{launcher}, first run")
    check_resumed(run(second + script, 120, env=env), out)


@pytest.mark.launcher
@pytest.mark.timeout(200)
def test_the_job_resumes_under_its_own_flag_and_refuses_a_journal_without_it(tmp_path):
    out = tmp_path / "out.npy"
    job = [PY, REPO / "jobs" / "scatter_gather.py", "--rows", 20000, "--chunk-rows", 2000, "--output", out]
    # an interrupted run's journal and partial output, made in a world of one
    env = clean_env()
    first = run(job + ["--resume", "--task", "copy"], 120, env=dict(env))
    assert first.returncode == 0 and "read parallel, write parallel" in first.stdout, first.stdout
    whole = np.load(out)
    out.unlink()
    code = f"""
import sys
sys.argv = {[str(x) for x in job[1:]] + ["--resume", "--task", "copy"]!r}
import numpy as np
import spmd.pipeline.tasks as tasks
real = tasks.build
def build(*a, **k):
    fn = real(*a, **k)
    calls = []
    def failing(block):
        calls.append(1)
        if len(calls) == 6:
            raise SystemExit(3)
        return fn(block)
    failing.spmd_task = fn.spmd_task
    return failing
tasks.build = build
exec(open(sys.argv[0]).read())
"""
    crashed = run([PY, "-c", code], 120, env=dict(env))
    assert crashed.returncode == 3 and partial_path(out).exists(), crashed.stdout
    refused = run(job + ["--task", "copy"], 120, env=dict(env))
    assert refused.returncode == 1 and "to continue at row 10000, or delete" in refused.stdout, refused.stdout
    resumed = run(job + ["--task", "copy", "--resume"], 120, env=dict(env))
    assert resumed.returncode == 0 and "resumed at row 10000 (5 rounds done before)" in resumed.stdout
    assert np.array_equal(np.load(out), whole)


class _Counted:
    """An input that records every read: what root reads beside the rounds' rows shows."""

    def __init__(self, rows):
        self.rows, self.shape, self.dtype, self.reads = rows, rows.shape, rows.dtype, []

    def read(self, start, stop):
        self.reads.append((start, stop))
        return self.rows[start:stop]


@pytest.mark.unit
def test_only_a_run_that_keeps_a_journal_fingerprints_its_input(tmp_path):
    rows = np.arange(6000 * 4, dtype=np.float32).reshape(6000, 4)
    plain = _Counted(rows)
    pipeline(lambda b: b * 2, plain, output=str(tmp_path / "plain.npy"), chunk_rows=1000)
    assert sum(b - a for a, b in plain.reads) == 6000, plain.reads  # the rounds' rows, nothing more
    kept = _Counted(rows)
    pipeline(lambda b: b * 2, kept, output=str(tmp_path / "kept.npy"), chunk_rows=1000, resume=True)
    singles = [r for r in kept.reads if r[1] - r[0] == 1]
    assert len(singles) == 17 and sum(b - a for a, b in kept.reads) == 6000 + 17, kept.reads
    assert np.array_equal(np.load(tmp_path / "plain.npy"), np.load(tmp_path / "kept.npy"))
