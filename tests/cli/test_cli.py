"""The spmd command: info, human and JSON, in a real MPI world and alone."""

import json
import os
from dataclasses import replace

import pytest
from click.testing import CliRunner

from tests.support import MPIRUN, clean_env, run, tool
from spmd.runtime import backends
from spmd.cli import main
from spmd.cli.info import gather_info, rank_lines, rank_row
from spmd.config.placement import detect, regroup


def no_launcher(**extra):
    """CliRunner's env: this process's launcher variables removed (as if alone), plus extra."""
    return {**{k: None for k in os.environ if k not in clean_env()}, **extra}


@pytest.mark.unit
def test_info_alone_in_json():
    result = CliRunner().invoke(main, ["info", "--json"], env=no_launcher(SPMD_BACKEND=""))
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["placement"]["launcher"] == "none" and report["placement"]["size"] == 1
    assert report["auto_backend"] == "serial"
    assert set(report["backends"]) == {"gloo", "nccl", "mpi"}
    assert report["error"] is None


@pytest.mark.unit
def test_info_reports_a_conflict_and_fails():
    env = no_launcher(RANK="5", WORLD_SIZE="2", SPMD_RANK="", SPMD_SIZE="")
    result = CliRunner().invoke(main, ["info"], env=env)
    assert result.exit_code == 1
    assert "RANK" in result.output and "WORLD_SIZE" in result.output


@pytest.mark.unit
def test_info_names_each_source_of_an_mpich_rank(monkeypatch):
    """The pure part of the test below: the environment Hydra gives rank 1 of 2."""
    hydra = {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "5", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    no_gpu = {"gloo": None, "nccl": "no usable CUDA device", "mpi": None}
    monkeypatch.setattr(backends, "available_backends", lambda: no_gpu)
    report, _ = gather_info(hydra)
    assert report["error"] is None and report["requested_backend"] == "auto"
    placement = report["placement"]
    assert (placement["launcher"], placement["rank"], placement["size"]) == ("mpich", 1, 2)
    assert placement["sources"]["rank"] == "PMI_RANK" and placement["sources"]["size"] == "PMI_SIZE"
    assert report["auto_backend"].startswith("mpi")
    monkeypatch.setattr(backends, "available_backends", lambda: {**no_gpu, "nccl": None})
    assert gather_info(hydra)[0]["auto_backend"] == "nccl"


@pytest.mark.unit
def test_a_ranks_row_and_the_table_say_where_it_runs_and_why():
    hydra = {"PMI_RANK": "1", "PMI_SIZE": "4", "PMI_FD": "5", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    placed = regroup(detect(hydra), [0, 1, 0, 1], "ranks grouped by host over MPI", ["h1", "h2", "h1", "h2"])
    why = "on 198.18.0.0/24, the network every other host (h1) has an address on"
    placed = replace(placed, address="198.18.0.12", interface="eth0", sources={**placed.sources, "address": why})
    row = rank_row(placed, "mpi")
    assert row == {"rank": 1, "host": "h2", "node_rank": 1, "num_nodes": 2, "local_rank": 0, "local_size": 2,
                   "address": "198.18.0.12", "interface": "eth0", "why": why,
                   "placed": "measured: ranks grouped by host over MPI", "backend": "mpi"}
    other = {**row, "rank": 10, "host": "h1", "node_rank": 0, "address": "198.18.0.101", "why": "SPMD_IFNAME=eth0"}
    assert rank_lines([row, other]) == [
        "ranks (placement measured from where each rank runs, not rank arithmetic: ranks grouped by host over MPI):",
        "  rank  host  node  local  address       interface  why",
        f"  1     h2    1/2   0/2    198.18.0.12   eth0       {why}",
        "  10    h1    0/2   0/2    198.18.0.101  eth0       SPMD_IFNAME=eth0"]
    guessed = {**row, "placed": "derived: rank // local_size (assumes ranks fill nodes in order)"}
    assert rank_lines([guessed])[0] == "ranks (placement: derived: rank // local_size (assumes ranks fill nodes in order)):"


@pytest.mark.launcher
@pytest.mark.timeout(60)
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found")
def test_info_under_mpirun_names_each_source(tmp_path):
    # Each rank writes its own file: under a launcher only rank 0 prints, with a row per rank.
    command = f"{tool('spmd')} info --json > {tmp_path}/info.$PMI_RANK"
    result = run([MPIRUN, "-n", 2, "sh", "-c", command], 50)
    assert result.returncode == 0, result.stdout
    assert (tmp_path / "info.1").read_text() == ""
    report = json.loads((tmp_path / "info.0").read_text())
    placement = report["placement"]
    assert (placement["launcher"], placement["rank"], placement["size"]) == ("mpich", 0, 2)
    assert placement["sources"]["rank"] == "PMI_RANK"
    assert report["backend"] == "mpi" and report["auto_backend"].startswith("mpi")
    assert [(r["rank"], r["node_rank"], r["local_rank"], r["interface"], r["why"]) for r in report["ranks"]] == [
        (0, 0, 0, "lo", "every rank is on this host"), (1, 0, 1, "lo", "every rank is on this host")]
