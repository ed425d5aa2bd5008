"""The world of one: every hook is a local no-op or copy."""

import numpy as np

from spmd.comms.contract import Backend
from spmd.comms.handle import Done, Handle
from spmd.comms.p2p.mailbox import Mailbox
from spmd.comms.p2p.incoming import TAG_STRIDE
from spmd.comms.state.caches import Caches

__all__ = ["SerialBackend"]


class SerialBackend(Backend):
    """The hooks of one rank; needs neither torch nor MPI."""

    name = "serial"
    rank, size = 0, 1

    def __init__(self, device="cpu", timeout=None, caches=None):
        self.device = device
        self.timeout = timeout
        self.caches = caches if caches is not None else Caches(1)
        self._mailbox = Mailbox()  # every message: a world of one sends only to itself

    @staticmethod
    def _give(result, async_op):
        return Done(result) if async_op else result

    def broadcast(self, x, root, async_op):
        return self._give(x, async_op)

    def reduce(self, x, root, op, async_op):
        return self._give(x, async_op)

    def all_reduce(self, x, op, async_op):
        return self._give(x, async_op)

    def scatter(self, parts, whole, layout, root, out, async_op):
        return self._give(_into(out, whole if parts is None else parts[0]), async_op)

    def gather(self, x, lengths, root, out, async_op):
        return self._give([_into(out, x)], async_op)

    def all_gather(self, x, lengths, out, async_op):
        return self._give([_into(out, x)], async_op)

    def all_to_all(self, parts, whole, sent, layout, out, async_op):
        chunk = whole if parts is None else parts[0]
        return self._give([_into(out, chunk) if out is not None else _copy(chunk)], async_op)

    def reduce_scatter(self, x, lengths, op, async_op):
        return self._give(_copy(x), async_op)

    def scan(self, x, exclusive, op, async_op):
        return self._give(x, async_op)

    def send(self, x, dst, tag, async_op):
        self._mailbox.put(x, tag)
        return Done(None) if async_op else None

    def recv(self, x, src, tag, async_op):
        user_tag = tag // TAG_STRIDE
        if not async_op:
            self._mailbox.take(x, tag, user_tag)
            return 0
        # An immediate receive may be posted before the send to itself it waits for.
        return Handle(lambda: self._mailbox.take(x, tag, user_tag), lambda: self._mailbox.has(tag), lambda: 0)

    def barrier(self):
        pass

    def allgather_ints(self, row):
        return row[None, :]

    def broadcast_ints(self, ints, root):
        return ints

    def broadcast_object(self, obj, root):
        return obj

    def gather_object(self, obj, root):
        return [obj]

    def all_gather_object(self, obj):
        return [obj]

    def scatter_object(self, objs, root):
        return objs[0]

    def split(self, color, key):
        if color is None:
            return None
        return SerialBackend(self.device, self.timeout, self.caches.child(1))

    def free(self):
        pass


def _copy(x):
    return x.copy() if isinstance(x, np.ndarray) else x.clone()


def _into(out, x):
    """Return x, or out holding a copy of x when out is given."""
    if out is None:
        return x
    if isinstance(out, np.ndarray):
        np.copyto(out, x)
    else:
        out.copy_(x)
    return out
