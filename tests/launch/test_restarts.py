"""spmd run --max-restarts (spmd.launch.restarts): the decisions, and real jobs relaunched after a failure."""

import os
import re
import signal
import textwrap
import uuid

import numpy as np
import pytest
from click.testing import CliRunner

from spmd.config.settings import parse_max_restarts
from spmd.errors import LaunchError, SettingsError
from spmd.launch import restarts
from spmd.launch.restarts import Attempt, decide, giving_up, launch_with_restarts, restarting
from spmd.pipeline import journal
from spmd.pipeline.sinks import partial_path

from tests.support import PY, REPO, clean_env, finish, left_behind, run, start, tool

JOB = REPO / "jobs" / "scatter_gather.py"


# -- unit: parsing, messages, the loop's decisions -----------------------------------------

@pytest.mark.unit
def test_max_restarts_comes_from_the_option_else_the_variable_else_zero():
    assert parse_max_restarts({}) == 0
    assert parse_max_restarts({"SPMD_MAX_RESTARTS": " "}) == 0
    assert parse_max_restarts({"SPMD_MAX_RESTARTS": "3"}) == 3
    assert parse_max_restarts({"SPMD_MAX_RESTARTS": "3"}, "0") == 0  # the option wins
    assert parse_max_restarts({"SPMD_MAX_RESTARTS": "bad"}, "2") == 2


@pytest.mark.unit
@pytest.mark.parametrize("environ, value, shown", [
    ({"SPMD_MAX_RESTARTS": "two"}, None, "SPMD_MAX_RESTARTS='two'"),
    ({"SPMD_MAX_RESTARTS": "-1"}, None, "SPMD_MAX_RESTARTS='-1'"),
    ({"SPMD_MAX_RESTARTS": "1.5"}, None, "SPMD_MAX_RESTARTS='1.5'"),
    ({}, "-2", "--max-restarts '-2'"),
    ({}, "", "--max-restarts ''"),
    ({}, True, "--max-restarts True"),
])
def test_a_bad_max_restarts_names_its_source_value_and_what_is_allowed(environ, value, shown):
    with pytest.raises(SettingsError) as info:
        parse_max_restarts(environ, value)
    assert str(info.value).startswith(shown + " is not a number of restarts")
    assert "whole number, 0 or more" in str(info.value)


def _cli(args, monkeypatch, **environ):
    from spmd.cli.run import run as command

    calls = []
    monkeypatch.setattr("spmd.cli.run.launch_with_restarts", lambda argv, n, **kw: calls.append((n, kw)) or 0)
    monkeypatch.delenv("SPMD_MAX_RESTARTS", raising=False)
    return CliRunner().invoke(command, args + [str(JOB)], env=environ), calls


@pytest.mark.unit
def test_the_cli_takes_the_option_over_the_variable_and_refuses_bad_values(monkeypatch):
    res, calls = _cli(["-n", "2", "--max-restarts", "2", "--restart-ranks", "3"], monkeypatch,
                      SPMD_MAX_RESTARTS="5")
    assert res.exit_code == 0 and calls[0][0] == 2, res.output
    assert calls[0][1]["max_restarts"] == 2 and calls[0][1]["restart_ranks"] == 3
    res, calls = _cli(["-n", "2"], monkeypatch, SPMD_MAX_RESTARTS="4")
    assert res.exit_code == 0 and calls[0][1]["max_restarts"] == 4 and calls[0][1]["restart_ranks"] is None
    res, calls = _cli(["-n", "2"], monkeypatch, SPMD_MAX_RESTARTS="four")
    assert res.exit_code == 2 and "SPMD_MAX_RESTARTS='four' is not a number of restarts" in res.output
    assert not calls
    res, calls = _cli(["-n", "2", "--max-restarts", "x"], monkeypatch)
    assert res.exit_code == 2 and "--max-restarts 'x' is not a number of restarts" in res.output
    res, calls = _cli(["-n", "2", "--restart-ranks", "3"], monkeypatch)
    assert res.exit_code == 2 and "--restart-ranks" in res.output and "--max-restarts" in res.output
    assert not calls
    from spmd.cli.run import run as command

    assert "--max-restarts" in CliRunner().invoke(command, ["--help"]).output


@pytest.mark.unit
def test_the_decisions_and_the_lines():
    killed = Attempt(0, 2, 137, rank=1, returncode=-9)
    assert decide(killed, 2) == "restart" and decide(killed, 0) == "give up"
    assert decide(Attempt(2, 2, 3, 1, 3), 2) == "give up"
    assert decide(Attempt(1, 2, 0), 2) == "done"
    assert decide(Attempt(0, 2, 130, stopped=2), 2) == "stopped"  # the user ended it
    assert decide(Attempt(0, 2, 143, rank=0, returncode=-15, stopped=15), 5) == "stopped"
    assert restarting(killed, 2, 2) == ("spmd run: attempt 1 of 3 failed (rank 1 killed by signal SIGKILL); "
                                        "restarting on 2 ranks (SPMD_RESTART_COUNT=1)\n")
    assert restarting(Attempt(1, 2, 3, 1, 3), 2, 1).endswith("restarting on 1 rank (SPMD_RESTART_COUNT=2)\n")
    assert giving_up(Attempt(2, 3, 3, 1, 3)) == ("spmd run: giving up after 3 attempts; the last failed "
                                                 "(rank 1 exited with code 3), exit status 3\n")
    assert Attempt(0, 2, 1).cause == "exit status 1"


def _fake(monkeypatch, outcomes):
    """Make restarts.launch return outcomes in turn, (code, rank, returncode, stopped); return its calls."""
    calls = []

    def launch(argv, nprocs, *, env, outcome, **options):
        code, rank, returncode, stopped = outcomes[len(calls)]
        calls.append((nprocs, env[restarts.COUNT], options))
        outcome.update(rank=rank, returncode=returncode, stopped=stopped)
        return code

    monkeypatch.setattr(restarts, "launch", launch)
    return calls


@pytest.mark.unit
def test_the_loop_relaunches_until_success_or_the_limit(monkeypatch):
    said = []
    calls = _fake(monkeypatch, [(137, 1, -9, None), (3, 0, 3, None), (0, None, None, None)])
    assert launch_with_restarts(["x.py"], 2, max_restarts=5, restart_ranks=3, env={}, say=said.append,
                                backend="gloo") == 0
    assert calls == [(2, "0", {"backend": "gloo"}), (3, "1", {"backend": "gloo"}), (3, "2", {"backend": "gloo"})]
    assert [s.split(";")[0] for s in said] == ["spmd run: attempt 1 of 6 failed (rank 1 killed by signal SIGKILL)",
                                              "spmd run: attempt 2 of 6 failed (rank 0 exited with code 3)"]
    said.clear()
    calls = _fake(monkeypatch, [(3, 1, 3, None)] * 3)
    assert launch_with_restarts(["x.py"], 2, max_restarts=2, env={}, say=said.append) == 3
    assert [c[:2] for c in calls] == [(2, "0"), (2, "1"), (2, "2")] and len(said) == 3
    assert said[-1].startswith("spmd run: giving up after 3 attempts")
    said.clear()
    _fake(monkeypatch, [(3, 1, 3, None)])
    assert launch_with_restarts(["x.py"], 2, env={}, say=said.append) == 3 and said == []  # no restarts: as ever
    calls = _fake(monkeypatch, [(130, None, None, 2)])  # stopped by the user: not relaunched
    assert launch_with_restarts(["x.py"], 2, max_restarts=3, env={}, say=said.append) == 130
    assert len(calls) == 1 and said == []


@pytest.mark.unit
@pytest.mark.parametrize("kw, word", [(dict(max_restarts=-1), "max_restarts"), (dict(max_restarts="2"), "max_restarts"),
                                      (dict(max_restarts=True), "max_restarts"),
                                      (dict(max_restarts=1, restart_ranks=0), "restart_ranks")])
def test_the_loop_checks_its_arguments(kw, word):
    with pytest.raises(LaunchError, match=rf"{word} must be an integer >= \d, got"):
        launch_with_restarts(["x.py"], 2, **kw)


# -- launcher: real jobs under spmd run and torchrun ------------------------------------------

def _marked_env(**extra):
    mark = f"spmd-restarts-{uuid.uuid4().hex[:12]}"
    return mark, clean_env(RESTARTS_MARK=mark, **extra)


def _script(tmp_path, body):
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return path


@pytest.mark.launcher
@pytest.mark.timeout(60)
def test_a_job_that_fails_once_is_relaunched_and_succeeds(tmp_path):
    script = _script(tmp_path, """
        import os, signal
        from spmd import comm
        count = os.environ["SPMD_RESTART_COUNT"]
        comm.barrier()
        print(f"rank {comm.rank} attempt {count}", flush=True)
        if comm.rank == 1 and count == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        comm.barrier()
    """)
    mark, env = _marked_env()
    res = run([tool("spmd"), "run", "-n", 2, "--max-restarts", 2, script], 50, env=env)
    assert not left_behind(mark)
    assert res.returncode == 0, res.stdout[-3000:]
    assert res.stdout.count("spmd run: rank 1 killed by signal SIGKILL\n") == 1, res.stdout
    assert res.stdout.count("spmd run: attempt 1 of 3 failed (rank 1 killed by signal SIGKILL); "
                            "restarting on 2 ranks (SPMD_RESTART_COUNT=1)\n") == 1, res.stdout
    assert res.stdout.count("spmd run: attempt") == 1 and "giving up" not in res.stdout
    assert sorted(re.findall(r"rank (\d) attempt 1", res.stdout)) == ["0", "1"], res.stdout


@pytest.mark.launcher
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["option, preload", "variable"])
def test_a_failure_that_repeats_is_given_up_on(tmp_path, how):
    script = _script(tmp_path, """
        import os, sys
        print("rank", os.environ["SPMD_RANK"], "attempt", os.environ["SPMD_RESTART_COUNT"], flush=True)
        if os.environ["SPMD_RANK"] == "1":
            sys.exit(3)
    """)
    if how == "variable":
        mark, env = _marked_env(SPMD_MAX_RESTARTS=1)
        args, attempts = [], 2
    else:  # the fork server of each attempt ends with it
        mark, env = _marked_env()
        args, attempts = ["--max-restarts", 2, "--preload", "json"], 3
    res = run([tool("spmd"), "run", "-n", 2, *args, script], 50, env=env)
    assert not left_behind(mark)
    assert res.returncode == 3, res.stdout[-3000:]
    assert re.findall(r"\[0\] rank 0 attempt (\d)", res.stdout) == [str(i) for i in range(attempts)], res.stdout
    assert res.stdout.count("spmd run: rank 1 exited with code 3\n") == attempts
    assert res.stdout.count("restarting on 2 ranks") == attempts - 1
    assert res.stdout.count(f"spmd run: giving up after {attempts} attempts; the last failed "
                            "(rank 1 exited with code 3), exit status 3\n") == 1, res.stdout


@pytest.mark.launcher
@pytest.mark.timeout(60)
def test_a_job_the_user_stops_is_not_relaunched(tmp_path):
    script = _script(tmp_path, """
        import os, time
        print("rank", os.environ["SPMD_RANK"], "attempt", os.environ["SPMD_RESTART_COUNT"], flush=True)
        time.sleep(60)
    """)
    mark, env = _marked_env()
    proc = start([tool("spmd"), "run", "-n", 2, "--max-restarts", 3, script], env)
    seen = [proc.stdout.readline() for _ in range(2)]
    assert all("attempt 0" in line for line in seen), seen
    proc.send_signal(signal.SIGTERM)
    res = finish(proc, 30)
    assert not left_behind(mark)
    assert res.returncode == 128 + signal.SIGTERM, res.stdout
    assert "spmd run: SIGTERM received, stopping" in res.stdout
    assert "attempt 1" not in res.stdout and "restarting" not in res.stdout and "giving up" not in res.stdout


# A wrapper of the pipeline job whose rank 1 SIGKILLs itself at its KILL_AT-th block (about
# halfway through its rounds) in the first attempt only, under spmd run or under torchrun.
DYING = """
import os, runpy, signal, sys
import spmd.pipeline.tasks as tasks

real = tasks.build
def build(*a, **k):
    fn = real(*a, **k)
    attempt = os.environ.get("SPMD_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT"))
    rank = os.environ.get("SPMD_RANK", os.environ.get("RANK"))
    calls = []
    def dying(block):
        calls.append(1)
        if attempt == "0" and rank == "1" and len(calls) == {kill_at}:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(block)
    dying.spmd_task = fn.spmd_task
    return dying
tasks.build = build
sys.argv = [{job!r}] + sys.argv[1:]
runpy.run_path({job!r}, run_name="__main__")
"""

ROWS, CHUNK = 40_000, 2_000  # 20 rounds


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """(input .npy, the output of an uninterrupted run of the job on it, in a world of one)."""
    where = tmp_path_factory.mktemp("table")
    source, reference = where / "in.npy", where / "reference.npy"
    np.save(source, np.random.default_rng(3).standard_normal((ROWS, 8)).astype(np.float32))
    res = run([PY, JOB, "--input", source, "--output", reference, "--task", "standardize",
               "--chunk-rows", CHUNK, "--quiet"], 60)
    assert res.returncode == 0 and reference.exists(), res.stdout[-3000:]
    return source, reference


def _resumed(res, out, reference, spmd_run=True):
    assert res.returncode == 0, res.stdout[-4000:]
    assert not spmd_run or res.stdout.count("spmd run: rank 1 killed by signal SIGKILL") == 1, res.stdout[-4000:]
    m = re.search(r"resumed at row (\d+) \((\d+) rounds done before\)", res.stdout)
    assert m and 0 < int(m[1]) < ROWS, res.stdout[-4000:]  # the relaunch continued, it did not start over
    assert out.read_bytes() == reference.read_bytes()
    assert not partial_path(out).exists() and not os.path.exists(journal.journal_path(out))


def _pipeline_cmd(tmp_path, source, out):
    wrapper = tmp_path / "dying.py"
    wrapper.write_text(DYING.format(job=str(JOB), kill_at=ROWS // CHUNK // 2))
    return [wrapper, "--input", source, "--output", out, "--task", "standardize",
            "--chunk-rows", CHUNK, "--resume"]


@pytest.mark.launcher
@pytest.mark.timeout(90)
@pytest.mark.parametrize("restart_ranks", [None, 3])
def test_a_pipeline_killed_halfway_resumes_in_the_relaunch_with_the_same_bytes(tmp_path, table, restart_ranks):
    source, reference = table
    out = tmp_path / "out.npy"
    mark, env = _marked_env()
    more = [] if restart_ranks is None else ["--restart-ranks", restart_ranks]
    res = run([tool("spmd"), "run", "-n", 2, "--max-restarts", 2, *more, *_pipeline_cmd(tmp_path, source, out)],
              80, env=env)
    assert not left_behind(mark)
    _resumed(res, out, reference)
    ranks = 2 if restart_ranks is None else 3
    assert res.stdout.count(f"restarting on {ranks} ranks (SPMD_RESTART_COUNT=1)") == 1, res.stdout[-3000:]
    assert f"{ranks} ranks, backend gloo" in res.stdout, res.stdout[-3000:]


@pytest.mark.launcher
@pytest.mark.timeout(120)
def test_under_torchrun_the_restarted_ranks_meet_again_and_resume(tmp_path, table):
    source, reference = table
    out = tmp_path / "out.npy"
    mark, env = _marked_env()
    torchrun = [PY, "-m", "torch.distributed.run", "--nproc-per-node", 2, "--max-restarts", 1]
    res = run(torchrun + _pipeline_cmd(tmp_path, source, out), 110, env=env)
    assert not left_behind(mark)
    _resumed(res, out, reference, spmd_run=False)
