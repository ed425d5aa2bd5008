"""Which backend to use, and which device each rank binds.

``auto`` (the default) picks nccl when CUDA is usable and the launcher
gave a local rank, mpi when an MPI launcher started the job and
mpi4py agrees with it, and gloo otherwise.  The choice comes from
``spmd.init(backend=...)``, else ``SPMD_BACKEND``, else ``auto``.
"""

import importlib.util
import os
import sys

from spmd.errors import BackendError
from spmd.config.settings import BACKENDS, parse_backend  # BACKENDS: the one list of names

__all__ = [
    "BACKENDS",
    "requested_backend",
    "available_backends",
    "cuda_usable",
    "cuda_device",
    "shared_gpu_error",
]


def requested_backend(backend=None, environ=None):
    """Return the backend asked for by argument, else SPMD_BACKEND, else 'auto'."""
    return parse_backend(os.environ if environ is None else environ, backend)


def cuda_usable():
    """Tell whether CUDA can be used, importing torch only if a GPU may exist."""
    if "torch" not in sys.modules and not os.path.exists("/dev/nvidiactl"):
        return False
    import torch

    return torch.cuda.is_available()


def _mpi4py_present():
    return importlib.util.find_spec("mpi4py") is not None


def available_backends():
    """Map each backend to None when usable here, else the reason it is not."""
    torch_ok = importlib.util.find_spec("torch") is not None
    out = {}
    out["gloo"] = None if torch_ok else "torch is not installed (pip install torch)"
    if not torch_ok:
        out["nccl"] = "torch is not installed"
    elif not cuda_usable():
        out["nccl"] = "no usable CUDA device"
    else:
        out["nccl"] = None
    out["mpi"] = None if _mpi4py_present() else "mpi4py is not installed (pip install 'spmd[mpi]')"
    return out


def check_available(name, available=None):
    """Raise a BackendError naming the usable backends unless name is one."""
    available = available_backends() if available is None else available
    reason = available.get(name)
    if reason is not None:
        usable = [n for n, why in available.items() if why is None] or ["none"]
        raise BackendError(
            f"backend {name!r} is not available here: {reason}. "
            f"Available: {', '.join(usable)}; pass backend=... or set SPMD_BACKEND"
        )


def cuda_device(local_rank, visible):
    """Return the device a rank binds: cuda:(local_rank % visible devices)."""
    if visible < 1:
        raise BackendError(
            "the nccl backend needs a GPU but this task sees none; check CUDA_VISIBLE_DEVICES "
            "and the scheduler's GPU request, or use the gloo or mpi backend"
        )
    return f"cuda:{local_rank % visible}"


def shared_gpu_error(bindings):
    """Return an error message if several ranks bind one GPU, else None.

    ``bindings`` lists ``(rank, host, gpu_uuid)`` for every rank.
    """
    seen = {}
    for rank, host, uuid in bindings:
        seen.setdefault((host, uuid), []).append(rank)
    shared = [(h, u, rs) for (h, u), rs in sorted(seen.items()) if len(rs) > 1]
    if not shared:
        return None
    what = "; ".join(f"ranks {rs} on {h} share GPU {u}" for h, u, rs in shared)
    return (
        f"nccl cannot run several ranks on one GPU: {what}. Start one rank per GPU "
        "(for example srun --gpus-per-task=1, or -n no larger than the GPUs per node), "
        "or use the gloo backend"
    )
