"""Tests of spmd.config.placement: launcher environments in, Placement out."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from spmd.errors import PlacementError
from spmd.config.placement import LAUNCHERS, MPI_LAUNCHERS, Placement, check_mpi_world, detect, regroup

pytestmark = pytest.mark.unit

NODE = "derived: rank // local_size (assumes ranks fill nodes in order)"
NODES = "derived: size // local_size"
ONE = "assumed: one node (no variable gives it)"
LAYOUT = ("rank", "size", "local_rank", "local_size", "node_rank", "num_nodes")

# Environments as each launcher sets them (plus a little of the usual noise).
MPICH_HYDRA = {  # mpirun -n 8 (mpich wheel), rank 3, one node
    "PMI_RANK": "3", "PMI_SIZE": "8", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "8",
    "PMI_FD": "6", "PMI_HOSTNAME": "host1", "HOME": "/root", "PATH": "/usr/bin",
}
OPENMPI_41 = {  # mpirun -n 8 --map-by ppr:4:node, rank 5 (second node)
    "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "OMPI_COMM_WORLD_NODE_RANK": "1", "OMPI_UNIVERSE_SIZE": "8",
    "PMIX_RANK": "5", "PMIX_NAMESPACE": "prterun-host1-1234@1", "PMIX_SERVER_URI41": "x",
}
MVAPICH = {  # mpirun_rsh -np 4, one rank per node, rank 2; Hydra-style PMI_* agree
    "MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "4",
    "MV2_COMM_WORLD_LOCAL_RANK": "0", "MV2_COMM_WORLD_LOCAL_SIZE": "1",
    "PMI_RANK": "2", "PMI_SIZE": "4", "MPIRUN_RANK": "2",
}
INTEL_MPI = {  # mpirun -n 16 -ppn 4, rank 6
    "PMI_RANK": "6", "PMI_SIZE": "16", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4",
    "I_MPI_ROOT": "/opt/intel/oneapi/mpi/2021.10.0", "I_MPI_HYDRA_TOPOLIB": "hwloc",
}
SLURM_STEP = {  # srun -N4 -n8, rank 5
    "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
    "SLURM_NTASKS": "8", "SLURM_NPROCS": "8", "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_NNODES": "4", "SLURM_JOB_NUM_NODES": "4", "SLURM_STEP_NUM_NODES": "4",
    "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_STEP_TASKS_PER_NODE": "2(x4)",
    "SLURM_STEP_NODELIST": "node[01-04]", "SLURM_JOB_NODELIST": "node[01-04]",
    "SLURM_NODELIST": "node[01-04]", "SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242",
    "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURMD_NODENAME": "node03",
    "SLURM_SRUN_COMM_HOST": "10.0.0.1",
}
SLURM_UNEVEN = {  # srun -N3 -n7: ranks 0-2 | 3-4 | 5-6; rank 4
    "SLURM_PROCID": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
    "SLURM_NTASKS": "7", "SLURM_STEP_NUM_TASKS": "7", "SLURM_NNODES": "3",
    "SLURM_STEP_NUM_NODES": "3", "SLURM_TASKS_PER_NODE": "3,2(x2)",
    "SLURM_STEP_TASKS_PER_NODE": "3,2,2", "SLURM_STEP_NODELIST": "gpu[1-3]",
    "SLURM_JOB_NODELIST": "gpu[1-3]", "SLURM_JOB_ID": "17", "SLURM_STEP_ID": "2",
}
TORCHRUN = {  # torchrun --nnodes 2 --nproc-per-node 4, node 1, rank 6
    "RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "6", "ROLE_WORLD_SIZE": "8",
    "ROLE_NAME": "default", "MASTER_ADDR": "node01", "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0", "OMP_NUM_THREADS": "1",
}
SPMD = {
    "SPMD_RANK": "1", "SPMD_SIZE": "4", "SPMD_LOCAL_RANK": "1", "SPMD_LOCAL_SIZE": "4",
    "SPMD_NODE_RANK": "0", "SPMD_NUM_NODES": "1",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511",
}
SBATCH_SCRIPT = {  # plain `python script.py` in an sbatch -N2 -n8 script
    "SLURM_JOB_ID": "99", "SLURM_NTASKS": "8", "SLURM_NPROCS": "8", "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NNODES": "2",
    "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODELIST": "n[1-2]",
}
SLURM_SIX = {"SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "4",
             "SLURM_STEP_TASKS_PER_NODE": "2(x4)", "SLURM_STEP_ID": "0",
             "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "2"}


def expected(layout, launcher, sources, **extra):
    """Build the as_dict() a case should give."""
    out = dict(zip(LAYOUT, layout), launcher=launcher, sources=sources, conflicts=[],
               master_addr=None, master_port=None, hosts=[], job_id=None, step_id=None, host=None, address=None, interface=None,
               is_mpi=launcher in MPI_LAUNCHERS)
    out.update(extra)
    return out


SLURM_SOURCES = {
    "rank": "SLURM_PROCID", "size": "SLURM_STEP_NUM_TASKS", "local_rank": "SLURM_LOCALID",
    "node_rank": "SLURM_NODEID", "num_nodes": "SLURM_STEP_NUM_NODES",
    "local_size": "derived from SLURM_STEP_TASKS_PER_NODE[SLURM_NODEID]",
}
CASES = {
    "mpich-hydra": (MPICH_HYDRA, expected(
        (3, 8, 3, 8, 0, 1), "mpich",
        {"rank": "PMI_RANK", "size": "PMI_SIZE", "local_rank": "MPI_LOCALRANKID",
         "local_size": "MPI_LOCALNRANKS", "node_rank": NODE, "num_nodes": NODES})),
    "openmpi-4.1": (OPENMPI_41, expected(
        (5, 8, 1, 4, 1, 2), "openmpi",
        {"rank": "OMPI_COMM_WORLD_RANK", "size": "OMPI_COMM_WORLD_SIZE",
         "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK", "local_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
         "node_rank": NODE, "num_nodes": NODES})),
    "mvapich": (MVAPICH, expected(
        (2, 4, 0, 1, 2, 4), "mvapich",
        {"rank": "MV2_COMM_WORLD_RANK", "size": "MV2_COMM_WORLD_SIZE",
         "local_rank": "MV2_COMM_WORLD_LOCAL_RANK", "local_size": "MV2_COMM_WORLD_LOCAL_SIZE",
         "node_rank": NODE, "num_nodes": NODES})),
    "intel-mpi": (INTEL_MPI, expected(
        (6, 16, 2, 4, 1, 4), "mpich",
        {"rank": "PMI_RANK", "size": "PMI_SIZE", "local_rank": "MPI_LOCALRANKID",
         "local_size": "MPI_LOCALNRANKS", "node_rank": NODE, "num_nodes": NODES})),
    "slurm-srun": (SLURM_STEP, expected(
        (5, 8, 1, 2, 2, 4), "slurm",
        {**SLURM_SOURCES, "hosts": "SLURM_STEP_NODELIST", "job_id": "SLURM_JOB_ID",
         "step_id": "SLURM_STEP_ID"},
        hosts=["node01", "node02", "node03", "node04"], job_id="4242", step_id="0")),
    "slurm-uneven": (SLURM_UNEVEN, expected(
        (4, 7, 1, 2, 1, 3), "slurm",
        {**SLURM_SOURCES, "hosts": "SLURM_STEP_NODELIST", "job_id": "SLURM_JOB_ID",
         "step_id": "SLURM_STEP_ID"},
        hosts=["gpu1", "gpu2", "gpu3"], job_id="17", step_id="2")),
    "torchrun": (TORCHRUN, expected(
        (6, 8, 2, 4, 1, 2), "torchrun",
        {"rank": "RANK", "size": "WORLD_SIZE", "local_rank": "LOCAL_RANK",
         "local_size": "LOCAL_WORLD_SIZE", "node_rank": "GROUP_RANK",
         "num_nodes": "GROUP_WORLD_SIZE", "master_addr": "MASTER_ADDR",
         "master_port": "MASTER_PORT"},
        master_addr="node01", master_port=29500)),
    "torchrun-no-group-size": (
        {k: v for k, v in TORCHRUN.items() if k not in ("GROUP_WORLD_SIZE", "MASTER_PORT")},
        expected((6, 8, 2, 4, 1, 2), "torchrun",
                 {"rank": "RANK", "size": "WORLD_SIZE", "local_rank": "LOCAL_RANK",
                  "local_size": "LOCAL_WORLD_SIZE", "node_rank": "GROUP_RANK",
                  "num_nodes": NODES, "master_addr": "MASTER_ADDR"},
                 master_addr="node01")),
    "spmd": (SPMD, expected(
        (1, 4, 1, 4, 0, 1), "spmd",
        {"rank": "SPMD_RANK", "size": "SPMD_SIZE", "local_rank": "SPMD_LOCAL_RANK",
         "local_size": "SPMD_LOCAL_SIZE", "node_rank": "SPMD_NODE_RANK",
         "num_nodes": "SPMD_NUM_NODES", "master_addr": "MASTER_ADDR",
         "master_port": "MASTER_PORT"},
        master_addr="127.0.0.1", master_port=29511)),
    "empty": ({}, expected((0, 1, 0, 1, 0, 1), "none", dict.fromkeys(LAYOUT, "default"))),
    "empty-strings-are-unset": ({"PMI_RANK": "", "RANK": "", "MASTER_PORT": ""},
                                expected((0, 1, 0, 1, 0, 1), "none",
                                         dict.fromkeys(LAYOUT, "default"))),
    "srun-mpi-pmi2": (  # MPICH ranks started by srun --mpi=pmi2: node layout from SLURM
        {**SLURM_SIX, "PMI_RANK": "5", "PMI_SIZE": "8", "PMI_FD": "4"},
        expected((5, 8, 1, 2, 2, 4), "mpich",
                 {**SLURM_SOURCES, "rank": "PMI_RANK", "size": "PMI_SIZE",
                  "step_id": "SLURM_STEP_ID"},
                 step_id="0")),
    "srun-mpi-pmix": (  # PMIx exports no size: it comes from the agreeing srun step
        {**SLURM_SIX, "PMIX_RANK": "5", "PMIX_NAMESPACE": "slurm.pmix.42.0"},
        expected((5, 8, 1, 2, 2, 4), "pmix",
                 {**SLURM_SOURCES, "rank": "PMIX_RANK", "step_id": "SLURM_STEP_ID"},
                 step_id="0")),
}


@pytest.mark.parametrize("env, want", CASES.values(), ids=CASES.keys())
def test_detect_launcher_environments(env, want):
    placement = detect(env)
    assert placement.as_dict() == want
    assert placement.is_mpi == (want["launcher"] in MPI_LAUNCHERS)


def test_detect_defaults_to_os_environ(monkeypatch):
    for name in list(os.environ):
        monkeypatch.delenv(name)
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    assert detect() == detect(TORCHRUN)
    assert detect().rank == 6


# --- traps -----------------------------------------------------------------------

def test_mpirun_inside_sbatch_mpi_wins_and_conflict_is_noted():
    env = {"PMI_RANK": "3", "PMI_SIZE": "8", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    placement = detect(env)
    assert (placement.launcher, placement.rank, placement.size) == ("mpich", 3, 8)
    (note,) = placement.conflicts
    assert "SLURM_PROCID=0" in note and "SLURM_NTASKS=2" in note and "PMI_RANK=3" in note
    assert "mpirun inside a SLURM allocation" in note


def test_mpirun_inside_sbatch_with_hydra_proxies_started_by_srun():
    # Hydra's proxies run as an srun step of one task per node: every rank sees SLURM_PROCID
    # of its proxy; the step does not agree with MPI, so no layout is taken from it.
    env = {**MPICH_HYDRA, "PMI_RANK": "5", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4",
           "SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
           "SLURM_NODEID": "1", "SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    placement = detect(env)
    assert (placement.rank, placement.size, placement.local_size) == (5, 8, 4)
    assert placement.node_rank == 1
    assert placement.sources["node_rank"] == NODE
    assert len(placement.conflicts) == 1 and "SLURM_PROCID=1" in placement.conflicts[0]


def test_agreeing_variables_are_not_conflicts():
    assert detect(OPENMPI_41).conflicts == ()  # PMIX_RANK beside OMPI_*
    assert detect({**SPMD, "RANK": "1", "WORLD_SIZE": "4"}).conflicts == ()


def test_plain_python_in_batch_script_is_a_world_of_one():
    placement = detect(SBATCH_SCRIPT)
    assert (placement.launcher, placement.rank, placement.size) == ("none", 0, 1)
    assert (placement.hosts, placement.job_id, placement.step_id) == (("n1", "n2"), "99", None)
    (note,) = placement.conflicts
    assert "SLURM_NTASKS=8" in note and "srun" in note


def test_batch_step_id_is_not_an_srun_step():
    assert detect({**SLURM_STEP, "SLURM_STEP_ID": "4294967291"}).launcher == "none"


def test_torchrun_started_by_srun_wins_over_the_step():
    env = {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
           "SLURM_NODEID": "1", "SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
           **TORCHRUN}
    placement = detect(env)
    assert (placement.launcher, placement.rank, placement.size) == ("torchrun", 6, 8)
    (note,) = placement.conflicts
    assert "SLURM_PROCID=1" in note and "RANK=6" in note


def test_hand_set_torchrun_variables_lose_to_mpi_with_a_note():
    placement = detect({**MPICH_HYDRA, "RANK": "0", "WORLD_SIZE": "8"})
    assert placement.launcher == "mpich" and placement.rank == 3
    (note,) = placement.conflicts
    assert "RANK=0 ignored" in note and "PMI_RANK=3" in note


@pytest.mark.parametrize("env, names", [
    ({"PMI_RANK": "3"}, ["PMI_RANK", "PMI_SIZE"]),
    ({"PMI_SIZE": "8"}, ["PMI_SIZE", "PMI_RANK"]),
    ({"RANK": "0"}, ["RANK", "WORLD_SIZE"]),
    ({"WORLD_SIZE": "4"}, ["WORLD_SIZE", "RANK"]),
    ({"OMPI_COMM_WORLD_RANK": "1"}, ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"]),
    ({"SPMD_SIZE": "2"}, ["SPMD_SIZE", "SPMD_RANK"]),
    ({"SLURM_PROCID": "1", "SLURM_STEP_ID": "0"}, ["SLURM_PROCID", "SLURM_NTASKS"]),
    ({"PMIX_RANK": "2"}, ["PMIX_RANK", "srun --mpi=pmix"]),
], ids=lambda v: ",".join(v) if isinstance(v, dict) else None)
def test_half_set_pairs_are_errors(env, names):
    with pytest.raises(PlacementError) as info:
        detect(env)
    for name in names:
        assert name in str(info.value)


@pytest.mark.parametrize("env, text", [
    ({"PMI_RANK": "three", "PMI_SIZE": "8"}, "PMI_RANK='three' is not an integer"),
    ({"RANK": "1.5", "WORLD_SIZE": "4"}, "RANK='1.5'"),
    ({"RANK": "0", "WORLD_SIZE": "-1"}, "WORLD_SIZE=-1 is negative"),
    ({**SLURM_STEP, "SLURM_NODEID": "x"}, "SLURM_NODEID='x'"),
    ({"PMI_RANK": "8", "PMI_SIZE": "8"}, "PMI_RANK=8 is not below PMI_SIZE=8"),
    ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "RANK=3 is not below WORLD_SIZE=2"),
    ({**TORCHRUN, "LOCAL_RANK": "4"}, "LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=4"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ({**SPMD, "SPMD_NODE_RANK": "1"}, "SPMD_NODE_RANK=1 is not below SPMD_NUM_NODES=1"),
    ({**SPMD, "SPMD_LOCAL_SIZE": "8"}, "SPMD_LOCAL_SIZE=8 is larger than SPMD_SIZE=4"),
    ({**SLURM_STEP, "SLURM_STEP_TASKS_PER_NODE": "2(x3)"},
     "SLURM_STEP_NUM_TASKS=8 but SLURM_STEP_TASKS_PER_NODE='2(x3)' adds up to 6"),
    ({**SBATCH_SCRIPT, "SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": "3(x2)"},
     "SLURM_NTASKS=8 but SLURM_TASKS_PER_NODE='3(x2)' adds up to 6"),
    ({**SLURM_STEP, "SLURM_STEP_TASKS_PER_NODE": "2(x)"}, "SLURM_STEP_TASKS_PER_NODE='2(x)'"),
    ({**SLURM_STEP, "SLURM_STEP_NUM_NODES": "3"}, "SLURM_STEP_NUM_NODES=3"),
    ({**SLURM_STEP, "SLURM_STEP_NODELIST": "node[01-"}, "SLURM_STEP_NODELIST='node[01-'"),
    ({"MV2_COMM_WORLD_RANK": "3", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "1"},
     "MV2_COMM_WORLD_LOCAL_RANK=1"),
])
def test_inconsistent_values_are_errors_that_name_the_variable(env, text):
    with pytest.raises(PlacementError) as info:
        detect(env)
    assert text in str(info.value)


@pytest.mark.parametrize("port", ["abc", "0", "65536", "-5", "29500.0"])
def test_bad_master_port(port):
    with pytest.raises(PlacementError) as info:
        detect({**SPMD, "MASTER_PORT": port})
    assert "MASTER_PORT" in str(info.value) and repr(port) in str(info.value)


def test_placement_error_is_a_value_error():
    with pytest.raises(ValueError):
        detect({"RANK": "0"})


def test_mpi_without_local_info_assumes_one_node():
    placement = detect({"PMI_RANK": "3", "PMI_SIZE": "8"})
    assert tuple(getattr(placement, f) for f in LAYOUT[2:]) == (3, 8, 0, 1)
    assert all(placement.sources[f] == ONE for f in LAYOUT[2:])


def test_uneven_local_size_without_node_info_is_flagged_as_a_guess():
    env = {"PMI_RANK": "6", "PMI_SIZE": "7", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "3"}
    placement = detect(env)
    assert (placement.node_rank, placement.num_nodes) == (2, 3)
    assert placement.sources["num_nodes"].startswith("guessed")


# --- check_mpi_world -------------------------------------------------------------

def test_check_mpi_world_singleton_under_srun():
    with pytest.raises(PlacementError) as info:
        check_mpi_world(detect(SLURM_STEP), 0, 1, "MPICH Version: 4.2.0")
    text = str(info.value)
    for needle in ("singleton", "--mpi=pmi2", "MpiDefault=pmi2", "SLURM_STEP_NUM_TASKS=8",
                   "MPICH Version: 4.2.0", "mpirun"):
        assert needle in text


def test_check_mpi_world_singleton_under_foreign_mpirun():
    with pytest.raises(PlacementError) as info:
        check_mpi_world(detect(OPENMPI_41), 0, 1, "Intel(R) MPI Library 2021.10")
    assert "OMPI_COMM_WORLD_SIZE=8" in str(info.value)
    assert "Intel(R) MPI Library 2021.10" in str(info.value)


@pytest.mark.parametrize("env, rank, size", [(SLURM_STEP, 5, 8), (MPICH_HYDRA, 3, 8),
                                             ({}, 0, 1), ({}, 2, 4)])
def test_check_mpi_world_agreement(env, rank, size):
    assert check_mpi_world(detect(env), rank, size) is None


def test_check_mpi_world_size_and_rank_mismatch():
    with pytest.raises(PlacementError, match="PMI_SIZE=8"):
        check_mpi_world(detect(MPICH_HYDRA), 3, 4)
    with pytest.raises(PlacementError, match="PMI_RANK=3"):
        check_mpi_world(detect(MPICH_HYDRA), 2, 8)


# --- the Placement object --------------------------------------------------------

def test_placement_is_frozen():
    placement = detect(SLURM_STEP)
    with pytest.raises(dataclasses.FrozenInstanceError):
        placement.rank = 0
    with pytest.raises(TypeError):
        placement.sources["rank"] = "x"
    assert hash(placement) == hash(detect(SLURM_STEP))


def test_as_dict_is_json_and_describe_lists_sources():
    placement = detect({"PMI_RANK": "3", "PMI_SIZE": "8", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    assert json.loads(json.dumps(placement.as_dict()))["is_mpi"] is True
    text = detect(SLURM_STEP).describe()
    for field in LAYOUT + ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "node[01-04]", "slurm"):
        assert field in text
    assert "SLURM_PROCID=0" in placement.describe()


def test_direct_construction_freezes_sources():
    placement = Placement(0, 2, 0, 2, 0, 1, "spmd", sources={"rank": "test"}, hosts=["a"])
    assert placement.sources["rank"] == "test" and placement.hosts == ("a",)
    with pytest.raises(TypeError):
        placement.sources["rank"] = "x"


def test_launcher_names():
    assert set(MPI_LAUNCHERS) == {"mpich", "openmpi", "pmix", "mvapich"}
    assert set(LAUNCHERS) == MPI_LAUNCHERS | {"slurm", "torchrun", "spmd", "none"}


def test_module_imports_neither_torch_nor_mpi4py():
    code = ("import sys, spmd.config.placement; "
            "assert not {'torch', 'mpi4py'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- regroup: node and local numbers from where the ranks really run --------------

HOW = "ranks compared their host cards"
MPICH_TWO_PER_NODE = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}


def test_regroup_corrects_the_guessed_node_of_round_robin_placement():
    """MPICH's rank // local_size puts rank 1 on node 0; round robin put it on node 1."""
    guessed = detect(MPICH_TWO_PER_NODE)
    assert guessed.node_rank == 0
    placement = regroup(guessed, [0, 1, 0, 1], HOW)
    assert [getattr(placement, f) for f in LAYOUT] == [1, 4, 0, 2, 1, 2]
    assert all(placement.sources[f] == f"measured: {HOW}" for f in LAYOUT[2:])
    assert placement.sources["rank"] == "PMI_RANK"
    (note,) = placement.conflicts
    assert note == f"node_rank 0 ({NODE}) corrected to 1: {HOW}"


def test_regroup_of_uneven_hosts():
    placement = regroup(detect({**MPICH_TWO_PER_NODE, "PMI_RANK": "3"}), [0, 0, 0, 1], HOW)
    assert (placement.local_rank, placement.local_size, placement.node_rank, placement.num_nodes) == (0, 1, 1, 2)
    assert [note.split(" (")[0] for note in placement.conflicts] == ["local_size 2"]
    middle = regroup(detect(MPICH_TWO_PER_NODE), [0, 0, 0, 1], HOW)
    assert (middle.local_rank, middle.local_size, middle.node_rank) == (1, 3, 0)
    assert [note.split(" (")[0] for note in middle.conflicts] == ["local_rank 0", "local_size 2"]


def test_regroup_that_agrees_adds_no_conflict_but_says_it_measured():
    placement = regroup(detect(SPMD), [0, 0, 0, 0], HOW)
    assert placement.conflicts == () and placement.sources["node_rank"] == f"measured: {HOW}"
    assert placement.host is None and "host" not in placement.sources


def test_regroup_keeps_earlier_conflicts_and_the_rest_of_the_placement():
    before = detect({**MPICH_TWO_PER_NODE, "RANK": "0", "WORLD_SIZE": "4", "MASTER_PORT": "29500"})
    after = regroup(before, [0, 1, 0, 1], HOW)
    assert after.conflicts[:-1] == before.conflicts and len(before.conflicts) == 1
    assert (after.rank, after.size, after.launcher, after.master_port) == (1, 4, "mpich", 29500)
    assert before.node_rank == 0  # the original is left as it was


def test_regroup_with_names_sets_the_host():
    placement = regroup(detect(MPICH_TWO_PER_NODE), [0, 1, 0, 1], HOW, ["a", "b", "a", "b"])
    assert placement.host == "b" and placement.sources["host"] == "measured: this rank's host name"
    assert placement.as_dict()["host"] == "b"
    assert "host        b        [measured: this rank's host name]" in placement.describe()


@pytest.mark.parametrize("hosts", [[0, 1, 0], [0, 1, 0, 1, 0]])
def test_regroup_with_the_wrong_number_of_hosts(hosts):
    with pytest.raises(PlacementError, match=f"{len(hosts)} ranks described their hosts, but the job has 4"):
        regroup(detect(MPICH_TWO_PER_NODE), hosts, HOW)
