"""Messages a rank sends to itself: kept here until it receives them.

MPI lets a rank send to itself; torch.distributed refuses, and a world
of one has nobody else.  The serial backend keeps every message here, and
the torch backends keep those whose destination is this rank.
"""

import collections

from spmd.errors import CollectiveError
from spmd.comms.arrays import byte_view, is_tensor

__all__ = ["Mailbox"]


def _bytes(a):
    """A contiguous array's bytes as a flat numpy uint8 view (a CPU copy for a device tensor)."""
    if is_tensor(a) and not a.is_cpu:
        a = a.detach().cpu()
    return byte_view(a)


class Mailbox:
    """Per tag, the arrays sent to this rank by itself, oldest first (copies, so the sender may reuse x)."""

    def __init__(self):
        self._boxes = collections.defaultdict(collections.deque)

    def put(self, x, tag):
        self._boxes[tag].append(_bytes(x).copy())

    def has(self, tag):
        return bool(self._boxes.get(tag))

    def take(self, x, tag, user_tag):
        """Copy the oldest message of tag into contiguous array x, or raise if there is none.

        Like MPI's and gloo's receives, x may be larger than the message (a header
        with inline data lands in a buffer with room for more); its first bytes are filled.
        """
        box = self._boxes.get(tag)
        if not box:
            raise CollectiveError(
                f"recv from this rank itself with tag {user_tag}: nothing was sent; a rank's send to itself "
                "must come before its receive (or use isend/irecv), else the receive would wait for ever"
            )
        data = box.popleft()
        if is_tensor(x) and not x.is_cpu:
            import torch

            x.as_strided((x.numel(),), (1,)).view(torch.uint8)[: data.nbytes].copy_(torch.from_numpy(data))
        else:
            _bytes(x)[: data.nbytes] = data
