"""Usage errors said once per job (spmd.runtime.usage): who speaks, what each rank prints, the statuses."""

import click
import pytest

from spmd.runtime import usage

pytestmark = pytest.mark.unit

RANK1 = {"PMI_RANK": "1", "PMI_SIZE": "2"}


@click.command()
@click.option("--rows", type=int, default=1)
@click.option("--input", "path")
def job(rows, path):
    if path == "both":
        raise click.UsageError("--rows cannot be used with --input")
    if path == "local":
        raise click.ClickException("this host lacks the file")
    print(f"rows {rows}")
    return rows


def ranked(monkeypatch, env):
    """This process as the rank env's launcher variables say (and not as a runtime another test started)."""
    import os

    monkeypatch.setattr("spmd.runtime.start.initialized", lambda: False)

    for key in [k for k in os.environ if k.startswith(("PMI_", "OMPI_", "SLURM_", "SPMD_", "MPI_LOCAL"))]:
        monkeypatch.delenv(key, raising=False)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("env, speaks", [({}, True), ({"PMI_RANK": "0", "PMI_SIZE": "2"}, True), (RANK1, False)])
def test_a_bad_option_is_printed_by_rank_0_alone_which_exits_2(monkeypatch, capsys, env, speaks):
    ranked(monkeypatch, env)
    with pytest.raises(usage.UsageExit) as got:
        usage.run_command(job, ["--bogus"], prog_name="job.py")
    out, err = capsys.readouterr()
    # A quiet rank exits 0: one that failed first had torchrun end rank 0 before it said why.
    assert got.value.code == (2 if speaks else 0) and out == ""
    if speaks:
        assert "No such option '--bogus'" in err and err.count("Usage: job.py") == 1, err
    else:
        assert err == ""


@pytest.mark.parametrize("env, speaks", [({}, True), (RANK1, False)])
def test_help_is_printed_once_and_ends_with_status_0(monkeypatch, capsys, env, speaks):
    ranked(monkeypatch, env)
    with pytest.raises(usage.UsageExit) as got:
        usage.run_command(job, ["--help"], prog_name="job.py")
    assert got.value.code == 0
    assert ("--rows" in capsys.readouterr().out) is speaks


@pytest.mark.parametrize("env, speaks", [({}, True), (RANK1, False)])
def test_a_usage_error_the_command_raises_is_said_once_and_other_errors_by_each(monkeypatch, capsys, env, speaks):
    ranked(monkeypatch, env)
    with pytest.raises(usage.UsageExit) as got:
        usage.run_command(job, ["--input", "both"])
    assert got.value.code == (2 if speaks else 0)
    assert ("cannot be used with --input" in capsys.readouterr().err) is speaks
    with pytest.raises(SystemExit) as got:
        usage.run_command(job, ["--input", "local"])
    assert not isinstance(got.value, usage.UsageExit) and got.value.code == 1
    assert "this host lacks the file" in capsys.readouterr().err


@pytest.mark.parametrize("env", [
    {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1",
     "SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0"},
    {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
    {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"},
], ids=["srun", "open-mpi", "torchrun"])
def test_rank_1_of_every_launcher_keeps_quiet(monkeypatch, capsys, env):
    ranked(monkeypatch, env)
    with pytest.raises(usage.UsageExit) as got:
        usage.run_command(job, ["--bogus"])
    assert got.value.code == 0 and capsys.readouterr() == ("", "")


def test_the_command_runs_and_returns_its_value(monkeypatch, capsys):
    ranked(monkeypatch, RANK1)
    assert usage.run_command(job, ["--rows", "5"]) == 5
    assert capsys.readouterr().out == "rows 5\n"  # the command's own output is every rank's


def test_say_once_per_host_speaks_on_each_hosts_first_rank(monkeypatch, capsys):
    ranked(monkeypatch, {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"})
    with pytest.raises(usage.UsageExit):
        usage.say_once("no such file", per_host=True)
    assert capsys.readouterr().err == "no such file\n"
    with pytest.raises(usage.UsageExit) as got:
        usage.say_once("bad", code=3)
    assert got.value.code == 0 and capsys.readouterr().err == ""  # rank 2 of the job keeps quiet
    ranked(monkeypatch, {"PMI_RANK": "0", "PMI_SIZE": "4"})
    with pytest.raises(usage.UsageExit) as got:
        usage.say_once("bad", code=3)
    assert got.value.code == 3 and capsys.readouterr().err == "bad\n"
