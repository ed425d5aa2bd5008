"""Starting torch.distributed's default group, and the backend of each torch transport over it."""

from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["init_process_group", "open_backend", "backend_class"]


def init_process_group(backend, store, rank, size, timeout, device):
    """Start torch.distributed's default group over a store (None: MPI meets by itself)."""
    kwargs = {"timeout": timedelta(seconds=timeout)}
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=size)
    if backend == "nccl":
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(backend, **kwargs)


def backend_class(name):
    """Return the backend class of a torch transport: gloo, nccl, or the general one (torch's mpi)."""
    if name == "gloo":
        from spmd.comms.backends.torchdist.gloo import GlooBackend

        return GlooBackend
    if name == "nccl":
        from spmd.comms.backends.torchdist.nccl import NcclBackend

        return NcclBackend
    from spmd.comms.backends.torchdist.backend import TorchBackend

    return TorchBackend


def open_backend(name, device="cpu", timeout=None, store=None):
    """Return the backend over the default group that init_process_group started."""
    return backend_class(name)(name, device, timeout=timeout, store=store)
