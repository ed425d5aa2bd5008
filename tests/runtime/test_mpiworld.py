"""MPI_Init bounded in time, with the reason said: the watcher, srun --mpi=pmi2, SPMD_IFNAME for MPI."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from spmd.errors import SettingsError

from spmd.runtime.mpiworld import PMI2_INIT_WITHIN, PMI2_STUCK, interface_for_mpi, srun_pmi2
from tests.support import REPO

pytestmark = pytest.mark.unit

SRUN_PMI2 = {"PMI_FD": "11", "PMI_JOBID": "7.0", "PMI_RANK": "0", "PMI_SIZE": "4", "SLURM_STEP_ID": "0"}
HYDRA = {"PMI_FD": "10", "PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "2", "MPI_LOCALRANKID": "0",
         "PMI_HOSTNAME": "h1"}


def test_srun_pmi2_is_told_from_hydra():
    assert srun_pmi2(SRUN_PMI2)
    assert not srun_pmi2(HYDRA)
    assert not srun_pmi2({**HYDRA, "SLURM_STEP_ID": "0"})  # mpirun inside sbatch: Hydra's ranks
    assert not srun_pmi2({})


def test_spmd_ifname_is_told_to_the_mpi_libraries_unless_they_were_told():
    env = {"SPMD_IFNAME": "lo"}
    interface_for_mpi(env)
    assert env["OMPI_MCA_btl_tcp_if_include"] == "lo" and env["UCX_NET_DEVICES"] == "lo"
    env = {"SPMD_IFNAME": "lo", "UCX_NET_DEVICES": "mlx5_0:1"}
    interface_for_mpi(env)
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1"
    env = {}
    interface_for_mpi(env)
    assert env == {}
    env = {"OMPI_MCA_btl_tcp_if_exclude": "docker0"}  # the user told Open MPI: left alone
    interface_for_mpi(env, "openmpi")
    assert env == {"OMPI_MCA_btl_tcp_if_exclude": "docker0"}
    env = {}
    interface_for_mpi(env, "mpich")  # Hydra's ranks: nothing found for them, nothing told
    assert env == {}
    with pytest.raises(SettingsError, match=r"SPMD_IFNAME=nosuch0 names no interface of host .*\(its interfaces: lo"):
        interface_for_mpi({"SPMD_IFNAME": "nosuch0"})


WATCHED = textwrap.dedent("""
    import sys, time
    from spmd.config.placement import detect
    from spmd.runtime.mpiworld import init_mpi_within, PMI2_STUCK

    class StuckMPI:  # MPI_Init that never returns, as under the PMI-2 fault
        THREAD_MULTIPLE = 3
        def Init_thread(self, level):
            time.sleep(60)

    placement = detect({"PMI_RANK": sys.argv[1], "PMI_SIZE": "2"})
    print("SPMD-PROMISE-AT", time.monotonic(), flush=True)
    init_mpi_within(StuckMPI(), placement, 1.0, PMI2_STUCK)
""")


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_stuck_mpi_init_under_srun_pmi2_ends_with_the_reason_from_rank_0(tmp_path, rank):
    script = tmp_path / "stuck.py"
    script.write_text(WATCHED)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    started = time.monotonic()
    done = subprocess.run([sys.executable, script, rank], capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == -9, done  # killed by its watcher
    assert time.monotonic() - started < 25
    if rank == "0":
        assert "MPI_Init under srun --mpi=pmi2 did not complete within 1 s" in done.stderr
        assert "SPMD_IFNAME" in done.stderr and "value not properly terminated" in done.stderr
    else:
        assert done.stderr == ""


def test_the_pmi2_bound_is_a_bound_and_the_message_formats():
    assert 30 <= PMI2_INIT_WITHIN <= 300
    assert "within 120 s" in PMI2_STUCK.format(seconds=120.0)
