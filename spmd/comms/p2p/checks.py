"""Point to point's checks and message building: peers, tags, plans, what arrives.

A mixin of :class:`~spmd.comms.p2p.methods.PointToPoint` (docs/comms.md,
"Point to point").
"""

import numpy as np

from spmd.errors import CollectiveError
from spmd.comms.state import meta
from spmd.comms.arrays import byte_view, dtype_name
from spmd.comms.p2p.incoming import HEADER_BYTES, TAG_STRIDE, VERDICT, WHERE
from spmd.comms.p2p.plan import MessagePlan

__all__ = ["MessageChecks"]


class MessageChecks:
    """_peer, _tag and _plan check a call's arguments; _prepare checks a header that came."""

    def _bytes_of(self, c):
        """Return contiguous CPU array or tensor c's memory as a writable 1-d numpy uint8 array."""
        return byte_view(c)

    def _packed(self, header, c, n):
        """One message: the header row, then c's n bytes."""
        buf = np.empty(HEADER_BYTES + n, np.uint8)
        buf[:HEADER_BYTES] = header.view(np.uint8)
        buf[HEADER_BYTES:] = self._bytes_of(c)
        return buf

    def _peer(self, rank, what):
        if type(rank) is int and 0 <= rank < self.size:
            return rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise CollectiveError(
                f"{what} {rank!r} is out of range: this communicator has ranks 0 to {self.size - 1}"
            )
        return int(rank)

    def _tag(self, tag):
        top = self._max_tag // TAG_STRIDE - 1
        if type(tag) is not int or not 0 <= tag <= top:
            if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= top:
                raise CollectiveError(
                    f"tag {tag!r} is not allowed: tags are integers from 0 to {top} on the {self.backend} backend"
                )
            tag = int(tag)
        return tag

    def _plan(self, x, what, strict=True):
        """Check x can travel and return its message's MessagePlan, worked out once per (type, dtype, shape).

        Not strict (a receive's out): None for an array no message can fill.
        """
        if type(x) is np.ndarray:
            key = (np.ndarray, x.dtype, x.shape)
        else:  # a tensor (a numpy subclass; anything else is refused on the miss)
            try:
                key = (type(x), x.dtype, x.shape, x.device)
            except AttributeError:
                key = (type(self._array(x, what)), x.dtype, x.shape)
        plan = self._descs.plans.get(key)
        if plan is None:
            self._array(x, what)
            if meta.dtype_code(x.dtype) < 0 or x.ndim > meta.MAX_TRAIL + 1:
                if not strict:
                    return None
                raise CollectiveError(
                    f"{what}: cannot send a {dtype_name(x)} array of {x.ndim} dimensions; send one of at "
                    f"most {meta.MAX_TRAIL + 1} dimensions, of a dtype among {', '.join(meta.DTYPES)}"
                )
            plan = self._descs.keep_plan(key, MessagePlan(self, x))
        return plan

    def _prepare(self, header, source, base, out):
        """The header from source has come: return (the buffer its data goes into, the result, error or None)."""
        header = header[: meta.WIDTH]
        kind, dtype, shape = self._descs.message(header)
        error = None
        if out is not None and (self._descs.row(out)[0][1:].tobytes() != header[1:].tobytes()):
            error = (
                f"recv from rank {source} (tag {base // TAG_STRIDE}): out is a {dtype_name(out)} array of "
                f"shape {tuple(out.shape)} but rank {source} sent {dtype} of shape {shape}; pass out of that "
                "dtype and shape, or no out to get a new array"
            )
        if self._mon.debug and source != self.rank:
            from spmd.failfast.calls import caller

            where = self._recv_bytes(source, base + WHERE)
            waits, where = where[:1] == "1", where[1:]
            if error:
                error += f" (send at {where}; recv at {caller()})"
            if waits:  # the sender waits for this verdict, and sends no data on a mismatch
                self._send_bytes(error or "", source, base + VERDICT)
                if error:
                    raise CollectiveError(error)
        if error:  # the data is drained into a sink, so the next message with this tag matches
            return self._p2p_array("numpy", dtype, shape), None, error
        result = self._p2p_array(kind, dtype, shape) if out is None else out
        return result, result, None

    def _p2p_array(self, kind, dtype, shape):
        """A new array for a received message: numpy, or a torch tensor on this backend's device."""
        if kind == "numpy":
            return np.empty(shape, dtype=dtype)
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
