"""Pure pieces of the runtime: backend choice, GPU binding, ports, addresses, the proxy."""

import socket
import subprocess

import numpy as np
import pytest

from tests.support import PY, clean_env
from spmd.runtime import backends
from spmd.runtime import rendezvous
from spmd.runtime import start as runtime
from spmd.comms.backends.serial import SerialBackend
from spmd.comms.comm import Comm
from spmd.errors import BackendError, CollectiveError, RendezvousError
from spmd.config.placement import detect

pytestmark = pytest.mark.unit


def test_requested_backend_precedence_and_validation():
    assert backends.requested_backend(None, {}) == "auto"
    assert backends.requested_backend(None, {"SPMD_BACKEND": "MPI"}) == "mpi"
    assert backends.requested_backend("gloo", {"SPMD_BACKEND": "mpi"}) == "gloo"
    with pytest.raises(BackendError, match="unknown backend 'tcp'.*SPMD_BACKEND.*gloo, nccl, mpi"):
        backends.requested_backend(None, {"SPMD_BACKEND": "tcp"})


def test_unavailable_backend_names_the_available_ones():
    available = {"gloo": None, "nccl": "no usable CUDA device", "mpi": None}
    backends.check_available("gloo", available)
    with pytest.raises(BackendError, match="'nccl' is not available here: no usable CUDA device.*Available: gloo, mpi"):
        backends.check_available("nccl", available)


def test_cuda_device_wraps_local_rank_over_visible_devices():
    assert backends.cuda_device(0, 4) == "cuda:0"
    assert backends.cuda_device(5, 4) == "cuda:1"
    assert backends.cuda_device(3, 1) == "cuda:0"  # per-task CUDA_VISIBLE_DEVICES
    with pytest.raises(BackendError, match="sees none"):
        backends.cuda_device(0, 0)


def test_several_ranks_on_one_gpu_are_refused():
    distinct = [(0, "n1", "GPU-a"), (1, "n1", "GPU-b"), (2, "n2", "GPU-a")]
    assert backends.shared_gpu_error(distinct) is None
    shared = [(0, "n1", "GPU-a"), (1, "n1", "GPU-b"), (2, "n1", "GPU-a")]
    message = backends.shared_gpu_error(shared)
    assert "ranks [0, 2] on n1 share GPU GPU-a" in message and "gpus-per-task" in message


def test_auto_choice_without_gpu(monkeypatch):
    monkeypatch.setattr(backends, "cuda_usable", lambda: False)  # the same on a GPU machine
    mpich = detect({"PMI_RANK": "0", "PMI_SIZE": "2"})
    assert runtime._choose("auto", mpich, object(), {}) == "mpi"
    assert runtime._choose("auto", mpich, None, {}) == "gloo"
    with pytest.raises(BackendError, match="needs an MPI launcher"):
        runtime._choose("mpi", detect({"SPMD_RANK": "0", "SPMD_SIZE": "2"}), None, {})


def test_auto_choice_with_a_gpu(monkeypatch):
    monkeypatch.setattr(backends, "cuda_usable", lambda: True)  # the same on a CPU machine
    mpich = detect({"PMI_RANK": "0", "PMI_SIZE": "2"})
    assert runtime._choose("auto", mpich, object(), {}) == "nccl"
    assert runtime._choose("auto", detect({"SPMD_RANK": "0", "SPMD_SIZE": "2"}), None, {}) == "nccl"
    assert runtime._choose("auto", detect({}), None, {}) == "gloo"  # no launcher: no GPU binding


def test_slurm_port_is_outside_the_ephemeral_range_and_spread():
    ports = {rendezvous.slurm_port(job, step) for job in range(1000, 1100) for step in range(3)}
    assert all(20000 <= p < 30000 for p in ports)
    assert len(ports) > 250  # jobs sharing digits do not share ports
    # every rank computes the port in its own process: it must not depend on the process
    # (as hash() of a str would, under PYTHONHASHSEED)
    code = "from spmd.runtime import rendezvous; print(rendezvous.slurm_port('123', '0'))"
    for seed in ("1", "2"):
        out = subprocess.run([PY, "-c", code], env=clean_env(PYTHONHASHSEED=seed),
                             capture_output=True, text=True, timeout=60)
        assert out.stdout.split() == [str(rendezvous.slurm_port("123", "0"))], out.stderr
    assert rendezvous.slurm_port("10123", "0") != rendezvous.slurm_port("20123", "0")


def test_unresolvable_address_is_named():
    assert rendezvous.check_address("127.0.0.1") == "127.0.0.1"
    with pytest.raises(RendezvousError, match="MASTER_ADDR='nowhere.invalid' does not resolve"):
        rendezvous.check_address("nowhere.invalid")


def test_a_busy_port_is_named_with_the_way_out():
    """The in-process part of test_failures' port-in-use world: rank 0's store cannot bind."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RendezvousError) as info:
            rendezvous._serve("127.0.0.1", port, 2, 5, b"0123456789abcdef")
    assert f"127.0.0.1:{port}" in str(info.value) and "in use" in str(info.value)
    assert "MASTER_PORT" in str(info.value)


def test_timeout_parsing():
    assert runtime._timeout(None, {}) == runtime.DEFAULT_TIMEOUT
    assert runtime._timeout(None, {"SPMD_TIMEOUT": "30"}) == 30.0
    assert runtime._timeout(5, {"SPMD_TIMEOUT": "30"}) == 5.0
    with pytest.raises(ValueError, match="positive number of seconds"):
        runtime._timeout("soon", {})


def test_serial_comm_api():
    c = Comm(SerialBackend(), detect({}))
    x = np.arange(4.0)
    assert c.all_reduce(x, op="avg") is x and c.broadcast(x) is x and c.reduce(x) is x
    assert np.array_equal(c.scatter(np.arange(6).reshape(3, 2)), np.arange(6).reshape(3, 2))
    assert c.gather(x)[0] is x and c.all_gather(x)[0] is x
    assert c.all_reduce(x, async_op=True).wait() is x
    assert c.scatter_object(["a"]) == "a" and c.gather_object(1) == [1]
    assert c.split(color=3).size == 1 and c.split(color=None) is None
    with pytest.raises(CollectiveError, match="expecting 1 chunks"):
        c.scatter([x, x])
    with pytest.raises(CollectiveError, match="out of range"):
        c.broadcast(x, root=1)


def test_import_is_light_and_comm_starts_on_first_use():
    code = (
        "import sys, spmd\n"
        "from spmd import comm\n"
        "assert 'torch' not in sys.modules and 'mpi4py' not in sys.modules\n"
        "assert not spmd.initialized()\n"
        "print(comm.rank, comm.size, comm.backend, spmd.initialized())\n"
        "assert 'torch' not in sys.modules\n"
    )
    out = subprocess.run([PY, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1", "serial", "True"]
