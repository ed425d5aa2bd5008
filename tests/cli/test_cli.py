"""The spmd command: info, human and JSON, in a real MPI world and alone."""

import json
import os

import pytest
from click.testing import CliRunner

from tests.support import MPIRUN, clean_env, run, tool
from spmd.runtime import backends
from spmd.cli import main
from spmd.cli.info import gather_info


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


@pytest.mark.launcher
@pytest.mark.timeout(60)
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found")
def test_info_under_mpirun_names_each_source(tmp_path):
    # Each rank writes its own file: mpirun may interleave the ranks' output.
    command = f"{tool('spmd')} info --json > {tmp_path}/info.$PMI_RANK"
    result = run([MPIRUN, "-n", 2, "sh", "-c", command], 50)
    assert result.returncode == 0, result.stdout
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("info.*"))]
    assert sorted(r["placement"]["rank"] for r in reports) == [0, 1]
    for r in reports:
        assert r["placement"]["launcher"] == "mpich"
        assert r["placement"]["sources"]["rank"] == "PMI_RANK"
        assert r["placement"]["size"] == 2
        assert r["auto_backend"].startswith("mpi")
