"""The nccl backend: CUDA tensors over torch.distributed's nccl process group.

Every collective takes :class:`~spmd.comms.backends.torchdist.backend.TorchBackend`'s general
path (torch.distributed's functions keep nccl's stream handling); what
nccl adds is where arrays must live.
"""

import numpy as np

from spmd.errors import CollectiveError
from spmd.comms.backends.torchdist.backend import TorchBackend

__all__ = ["NcclBackend"]


class NcclBackend(TorchBackend):
    """The hooks over an nccl process group; arrays must be CUDA tensors."""

    def check_device(self, x, what):
        if isinstance(x, np.ndarray) or x.device.type != "cuda":
            raise CollectiveError(
                f"{what} is on the CPU but the nccl backend works on CUDA tensors; "
                f"move it with torch.as_tensor(x).to(comm.device) (here {self.device}), "
                "or use the gloo or mpi backend for CPU data"
            )
