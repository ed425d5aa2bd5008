"""The spmd command: info, human and JSON, in a real MPI world and alone."""

import json

import pytest
from click.testing import CliRunner

from conftest import MPIRUN, run, tool
from spmd.cli import main


@pytest.mark.unit
def test_info_alone_in_json():
    result = CliRunner().invoke(main, ["info", "--json"], env={"SPMD_BACKEND": ""})
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["placement"]["launcher"] in ("none", "spmd", "mpich", "openmpi", "slurm", "torchrun")
    assert set(report["backends"]) == {"gloo", "nccl", "mpi"}
    assert report["error"] is None


@pytest.mark.unit
def test_info_reports_a_conflict_and_fails():
    env = {"RANK": "5", "WORLD_SIZE": "2", "SPMD_RANK": "", "SPMD_SIZE": ""}
    result = CliRunner().invoke(main, ["info"], env=env)
    assert result.exit_code == 1
    assert "RANK" in result.output and "WORLD_SIZE" in result.output


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
