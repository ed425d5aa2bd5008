"""The nccl backend: CUDA tensors over torch.distributed's nccl process group.

Every collective takes :class:`~spmd.comms.backends.torchdist.base.TorchComm`'s general
path (torch.distributed's functions keep nccl's stream handling); what
nccl adds is where arrays must live.
"""

import numpy as np

from spmd.errors import CollectiveError
from spmd.comms.backends.torchdist.base import TorchComm

__all__ = ["NcclComm"]


class NcclComm(TorchComm):
    """A communicator backed by an nccl process group; arrays must be CUDA tensors."""

    def _check_device(self, x, what):
        if isinstance(x, np.ndarray) or x.device.type != "cuda":
            raise CollectiveError(
                f"{what} is on the CPU but the nccl backend works on CUDA tensors; "
                f"move it with torch.as_tensor(x).to(comm.device) (here {self.device}), "
                "or use the gloo or mpi backend for CPU data"
            )
