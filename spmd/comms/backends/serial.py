"""The world of one: every collective is a local no-op or copy."""

import numpy as np

from spmd.comms.base import Comm
from spmd.comms.handle import Done, Handle
from spmd.comms.p2p.mailbox import Mailbox
from spmd.comms.p2p.incoming import TAG_STRIDE

__all__ = ["SerialComm"]


class SerialComm(Comm):
    """A communicator with one rank; needs neither torch nor MPI."""

    backend = "serial"

    def __init__(self, placement=None, device="cpu", timeout=None, monitor=None, caches=None):
        super().__init__(0, 1, placement, device, timeout, monitor, caches)
        self._mailbox = Mailbox()  # every message: a world of one sends only to itself

    @staticmethod
    def _give(result, async_op):
        return Done(result) if async_op else result

    def _broadcast(self, x, root, async_op):
        return self._give(x, async_op)

    def _reduce(self, x, root, op, async_op):
        return self._give(x, async_op)

    def _all_reduce(self, x, op, async_op):
        return self._give(x, async_op)

    def _scatter(self, parts, whole, layout, root, out, async_op):
        return self._give(_into(out, whole if parts is None else parts[0]), async_op)

    def _gather(self, x, lengths, root, out, async_op):
        return self._give([_into(out, x)], async_op)

    def _all_gather(self, x, lengths, out, async_op):
        return self._give([_into(out, x)], async_op)

    def _all_to_all(self, parts, whole, sent, layout, out, async_op):
        chunk = whole if parts is None else parts[0]
        return self._give([_into(out, chunk) if out is not None else _copy(chunk)], async_op)

    def _reduce_scatter(self, x, lengths, op, async_op):
        return self._give(_copy(x), async_op)

    def _scan(self, x, exclusive, op, async_op):
        return self._give(x, async_op)

    def _send(self, x, dst, tag, async_op):
        self._mailbox.put(x, tag)
        return Done(None) if async_op else None

    def _recv(self, x, src, tag, async_op):
        user_tag = tag // TAG_STRIDE
        if not async_op:
            self._mailbox.take(x, tag, user_tag)
            return 0
        # An immediate receive may be posted before the send to itself it waits for.
        return Handle(lambda: self._mailbox.take(x, tag, user_tag), lambda: self._mailbox.has(tag), lambda: 0)

    def _barrier(self):
        pass

    def _allgather_ints(self, row):
        return row[None, :]

    def _broadcast_ints(self, ints, root):
        return ints

    def _broadcast_object(self, obj, root):
        return obj

    def _gather_object(self, obj, root):
        return [obj]

    def _all_gather_object(self, obj):
        return [obj]

    def _scatter_object(self, objs, root):
        return objs[0]

    def _split_comm(self, color, key):
        if color is None:
            return None
        return SerialComm(self.placement, self.device, self.timeout, self._mon.child(), self._caches.child(1))

    def _free(self):
        self._mon.forget()
        self._caches.clear()


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
