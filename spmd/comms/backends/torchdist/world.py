"""Starting torch.distributed's default group, and the communicator of each torch backend."""

from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["init_process_group", "open_comm", "comm_class"]


def init_process_group(backend, store, rank, size, timeout, device):
    """Start torch.distributed's default group over a store (None: MPI meets by itself)."""
    kwargs = {"timeout": timedelta(seconds=timeout)}
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=size)
    if backend == "nccl":
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(backend, **kwargs)


def comm_class(backend):
    """Return the communicator class of a torch backend: gloo, nccl, or the general one (torch's mpi)."""
    if backend == "gloo":
        from spmd.comms.backends.torchdist.gloo import GlooComm

        return GlooComm
    if backend == "nccl":
        from spmd.comms.backends.torchdist.nccl import NcclComm

        return NcclComm
    from spmd.comms.backends.torchdist.base import TorchComm

    return TorchComm


def open_comm(backend, placement, device="cpu", timeout=None, monitor=None, store=None):
    """Return the world communicator over the default group that init_process_group started."""
    return comm_class(backend)(backend, placement, device, timeout=timeout, monitor=monitor, store=store)
