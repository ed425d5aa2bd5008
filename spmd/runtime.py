"""The process-wide communicator: started once by init, ended by finalize."""

import atexit
import os
import sys
import threading

from . import backends
from .errors import BackendError
from .placement import check_mpi_world, detect

__all__ = ["init", "finalize", "initialized", "DEFAULT_TIMEOUT"]

#: Seconds init and every collective may wait for the other ranks.
DEFAULT_TIMEOUT = 1800.0

_lock = threading.RLock()
_comm = None


def _timeout(timeout, environ):
    value = timeout if timeout is not None else environ.get("SPMD_TIMEOUT")
    if value is None or value == "":
        return DEFAULT_TIMEOUT
    if hasattr(value, "total_seconds"):
        value = value.total_seconds()
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {value!r}")
    return seconds


def _mpi_world(placement):
    """Return MPI.COMM_WORLD if mpi4py is importable and agrees with the launcher."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    world = MPI.COMM_WORLD
    check_mpi_world(placement, world.Get_rank(), world.Get_size(), MPI.Get_library_version())
    return world


def _choose(requested, placement, mpi_world, environ):
    """Return the backend to run, given what was requested and what works."""
    if requested == "auto":
        if placement.launcher != "none" and backends.cuda_usable():
            return "nccl"
        if mpi_world is not None:
            return "mpi"
        return "gloo"
    backends.check_available(requested)
    if requested == "mpi" and mpi_world is None:
        raise BackendError(
            f"backend 'mpi' needs an MPI launcher, but this job was started by "
            f"{placement.launcher}; start it with mpirun (or srun --mpi=pmi2), "
            "or choose the gloo backend"
        )
    return requested


def _nccl_device(placement, store):
    """Bind this rank's GPU, refusing several ranks on one GPU before NCCL starts."""
    import socket

    import torch

    device = backends.cuda_device(placement.local_rank, torch.cuda.device_count())
    torch.cuda.set_device(device)
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    store.set(f"spmd/gpu/{placement.rank}", f"{socket.gethostname()}\n{uuid}")
    bindings = []
    for r in range(placement.size):
        host, gpu = store.get(f"spmd/gpu/{r}").decode().split("\n")
        bindings.append((r, host, gpu))
    error = backends.shared_gpu_error(bindings)
    if error:
        raise BackendError(error)
    return device


def _start(backend, timeout, environ):
    placement = detect(environ)
    seconds = _timeout(timeout, environ)
    requested = backends.requested_backend(backend, environ)
    if placement.size == 1:
        from .comms.serial import SerialComm

        device = "cuda:0" if requested == "nccl" and backends.cuda_usable() else "cpu"
        return SerialComm(placement, device, seconds)
    mpi_world = _mpi_world(placement) if placement.is_mpi else None
    name = _choose(requested, placement, mpi_world, environ)
    torch_mpi = name == "mpi" and "torch" in sys.modules and _torch_has_mpi()
    if name == "mpi" and not torch_mpi:
        from .comms.mpi import MpiComm

        return MpiComm(mpi_world, placement, seconds)
    from .comms.torchdist import TorchComm, init_process_group
    from .rendezvous import rendezvous

    store, device = None, "cpu"
    if not torch_mpi:  # torch's own MPI group meets through MPI itself
        store, _, _ = rendezvous(placement, seconds, mpi_world, environ)
    if name == "nccl":
        device = _nccl_device(placement, store)
    init_process_group(name, store, placement.rank, placement.size, seconds, device)
    return TorchComm(name, placement, device, timeout=seconds)


def _torch_has_mpi():
    import torch.distributed as dist

    return dist.is_mpi_available()


def init(backend=None, timeout=None):
    """Start the runtime once and return the global communicator.

    backend: "auto" (default), "gloo", "nccl" or "mpi"; else SPMD_BACKEND.
    timeout: seconds (or a timedelta) that init and each collective may
    wait; else SPMD_TIMEOUT, else 1800.  Later calls return the same
    communicator, and raise if they ask for a different backend.
    """
    global _comm
    with _lock:
        if _comm is None:
            _comm = _start(backend, timeout, os.environ)
            atexit.register(finalize)
            return _comm
        if backend not in (None, "auto", _comm.backend) and _comm.size > 1:
            raise BackendError(
                f"spmd is already running on backend {_comm.backend!r}; call spmd.init(backend=...) "
                "before the first use of comm, or spmd.finalize() first"
            )
        if timeout is not None and _timeout(timeout, {}) != _comm.timeout:
            raise ValueError(
                f"spmd is already running with a timeout of {_comm.timeout:g} s; call "
                "spmd.init(timeout=...) before the first use of comm, or set SPMD_TIMEOUT"
            )
        return _comm


def initialized():
    """Tell whether init has run (and finalize has not)."""
    return _comm is not None


def finalize():
    """End the runtime: destroy the process group; safe to call twice."""
    global _comm
    with _lock:
        if _comm is None:
            return
        _comm._close()
        _comm = None
        from . import _proxy

        _proxy.comm._forget()

