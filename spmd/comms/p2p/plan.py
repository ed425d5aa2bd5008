"""What point to point keeps per message kind, and its handles (docs/comms.md).

:class:`MessagePlan` is worked out once per (type, dtype, shape) on a
communicator; :class:`Received` is an immediate receive in flight.
"""

import numpy as np

from spmd.comms.arrays import is_tensor
from spmd.comms.handle import Handle
from spmd.comms.p2p.incoming import HEADER_BYTES

__all__ = ["MessagePlan", "Received", "Finished", "nbytes", "VERDICT_AFTER"]

#: In debug mode, a blocking send of more bytes than this waits for the receiver's verdict
#: (above every eager limit: such a send waits for its receive in raw MPI too).
VERDICT_AFTER = 64 << 10


def nbytes(x):
    """The bytes of numpy array or torch tensor x."""
    return x.nbytes if isinstance(x, np.ndarray) else x.numel() * x.element_size()


class Received(Handle):
    """An immediate receive in flight; ``wait()`` gives the array; then ``source`` and ``tag`` are set."""

    __slots__ = ("source", "tag")

    def __init__(self, wait, test, finish, tag):
        super().__init__(wait, test, finish)
        self.source, self.tag = None, tag


class Finished(Handle):
    """A handle for a send that is over before it was returned."""

    __slots__ = ()

    def __init__(self, result):
        self._done, self._result = True, result


class MessagePlan:
    """A message of one (type, dtype, shape) on one communicator, worked out once.

    Its header row; the row's bytes after the kind (what a receive into
    ``out`` compares); its data's size and whether it goes inline; and,
    inline, a scratch message with the header filled in for blocking
    sends, with numpy views of its data and of the communicator's receive
    header's data in x's dtype and shape (numpy dtypes: one copy each).
    """

    __slots__ = ("row", "tail", "nbytes", "inline", "scratch", "sending", "receiving", "cpu_tensor",
                 "sending_at", "receiving_at")

    def __init__(self, comm, x):
        row = self.row = comm._descs.row(x)[0]
        self.tail, self.nbytes = row.tobytes()[8:], nbytes(x)
        self.inline = 0 < self.nbytes <= comm._backend.inline_bytes
        self.scratch = self.sending = self.receiving = None
        self.cpu_tensor = False  # a CPU tensor's bytes are copied by address (memmove)
        self.sending_at = self.receiving_at = 0
        if self.inline:
            self.scratch = np.empty(HEADER_BYTES + self.nbytes, np.uint8)
            self.scratch[:HEADER_BYTES] = row.view(np.uint8)
            received = comm._recv_header.view(np.uint8)[HEADER_BYTES : HEADER_BYTES + self.nbytes]
            if isinstance(x.dtype, np.dtype):
                self.sending = self.scratch[HEADER_BYTES:].view(x.dtype).reshape(x.shape)
                self.receiving = received.view(x.dtype).reshape(x.shape)
            elif is_tensor(x) and x.is_cpu:
                self.cpu_tensor = True
                self.sending_at = self.scratch[HEADER_BYTES:].ctypes.data
                self.receiving_at = received.ctypes.data
