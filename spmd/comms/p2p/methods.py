"""Point-to-point messages: send, recv, their immediate forms, sendrecv, and objects.

A mixin of :class:`~spmd.comms.comm.Comm`: it checks arguments and builds
messages; the backend moves bytes with two hooks, ``send`` and ``recv``.
A message is a header (the array's kind, dtype and shape), then the data;
small data travels inside the header's message.  With ``SPMD_DEBUG=1`` a
sender also sends its call site, and the sender of a blocking send of over
64 KiB waits for the receiver's verdict, so both ranks raise a mismatch.
Tags, buffers, mismatches and debug mode: docs/comms.md, "Point to point".
Message plans are in :mod:`~spmd.comms.p2p.plan`, receives in flight in
:mod:`~spmd.comms.p2p.incoming`.
"""

from __future__ import annotations

import pickle
import time
from ctypes import memmove
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from spmd.errors import CollectiveError, CollectiveTimeout
from spmd.failfast.calls import caller, timed_out
from spmd.comms.arrays import contiguous, dtype_name, is_tensor
from spmd.comms.handle import Handle
from spmd.comms.state import meta
from spmd.comms.p2p.incoming import (
    DATA,
    HEADER,
    HEADER_BYTES,
    TAG_STRIDE,
    VERDICT,
    WHERE,
    Incoming,
    Threaded,
    all_done,
    land,
)
from spmd.comms.p2p.plan import VERDICT_AFTER, Finished, MessagePlan, Received

if TYPE_CHECKING:
    from spmd.comms.types import Array, ArrayT

__all__ = ["PointToPoint", "Received", "HEADER", "DATA", "WHERE", "VERDICT", "TAG_STRIDE", "VERDICT_AFTER"]


class PointToPoint:
    """send, recv, isend, irecv, sendrecv, send_object, recv_object.

    Long because its one job is: the public calls, their checks, the messages
    they build and take apart, and debug mode's call sites and verdicts.
    """

    #: Immediate receives whose header has not come yet: every wait here moves them on
    #: (a list of the communicator's own, made by Comm.__init__).
    _incoming: list[Any] | tuple[()] = ()

    # -- sends -----------------------------------------------------------------------

    @overload
    def send(self, x: Array, dst: int, tag: int = 0, async_op: Literal[False] = False) -> None: ...
    @overload
    def send(self, x: Array, dst: int, tag: int = 0, *, async_op: Literal[True]) -> Handle[None]: ...
    @overload
    def send(self, x: Array, dst: int, tag: int = 0, async_op: bool = False) -> Handle[None] | None: ...

    def send(self, x: Array, dst: int, tag: int = 0, async_op: bool = False) -> Handle[None] | None:
        """Send x (a numpy array or torch tensor) to rank dst; its dtype, shape and kind travel with it.

        Blocks until x may be reused (which, for a large x, may be until
        the receiver has posted its receive); with ``async_op=True``
        returns a handle instead, like :meth:`isend`.
        """
        dst, tag = self._peer(dst, "dst"), self._tag(tag)
        plan = self._plan(x, "send")
        c = x if (x.flags.c_contiguous if type(x) is np.ndarray else x.is_contiguous()) else contiguous(x)[0]
        args = (c, plan, dst, tag, async_op)
        return self._call(self._send_message, args, "send", x, dst, tag, async_op, collective=False)

    def isend(self, x: Array, dst: int, tag: int = 0) -> Handle[None]:
        """Start sending x to rank dst; return a handle whose ``wait()`` returns once x may be reused."""
        return self.send(x, dst, tag, async_op=True)

    def _send_message(self, c, plan, dst, tag, async_op):
        base = TAG_STRIDE * tag
        header, n, inline = plan.row, plan.nbytes, plan.inline
        if self._mon.debug and dst != self.rank:  # a rank cannot wait for its own verdict
            return self._send_checked(c, header, dst, base, async_op, n, inline)
        pending = async_op or bool(self._incoming)
        if inline and not pending:  # the blocking send is over before the scratch is used again
            if plan.sending is not None and type(c) is np.ndarray:
                plan.sending[...] = c
            elif plan.cpu_tensor:
                memmove(plan.sending_at, c.data_ptr(), plan.nbytes)
            else:
                plan.scratch[HEADER_BYTES:] = self._backend.bytes_of(c)
            self._backend.send(plan.scratch, dst, base + HEADER, False)
            return None
        if inline:
            packed = self._packed(header, c, n)
            works = [self._backend.send(packed, dst, base + HEADER, pending)]
            c = packed
        else:
            works = [self._backend.send(header, dst, base + HEADER, pending)]
            if n:
                works.append(self._backend.send(c, dst, base + DATA, pending))
        if not pending:
            return None
        handle = Handle(lambda: self._progressing(works), lambda: all_done(works), lambda: (c, header) and None)
        return handle if async_op else handle.wait()

    # -- receives --------------------------------------------------------------------

    @overload
    def recv(self, src: int | None = None, tag: int = 0, *, out: None = None, status: Literal[False] = False,
             async_op: Literal[False] = False) -> Array: ...
    @overload
    def recv(self, src: int | None = None, tag: int = 0, *, out: ArrayT, status: Literal[False] = False,
             async_op: Literal[False] = False) -> ArrayT: ...
    @overload
    def recv(self, src: int | None = None, tag: int = 0, *, out: Array | None = None, status: Literal[True],
             async_op: Literal[False] = False) -> tuple[Array, int, int]: ...
    @overload
    def recv(self, src: int | None = None, tag: int = 0, *, out: Array | None = None, status: bool = False,
             async_op: Literal[True]) -> Received: ...

    def recv(self, src: int | None = None, tag: int = 0, *, out: Array | None = None, status: bool = False,
             async_op: bool = False) -> Any:
        """Receive an array from rank src (None: from any rank) sent with this tag.

        Returns the array as sent (a new numpy array or torch tensor of
        its dtype and shape), or, with ``out``, fills out (same shape and
        dtype, else CollectiveError) and returns it.  With ``status=True``
        returns ``(array, source, tag)``.  With ``async_op=True`` returns
        a handle, like :meth:`irecv`.
        """
        src = None if src is None else self._peer(src, "src")
        tag = self._tag(tag)
        plan = None if out is None else self._plan(out, "out", strict=False)
        if async_op:
            return self._call(self._irecv_message, (src, tag, out), "recv", out, src, tag, True, collective=False)
        got, source = self._call(self._recv_message, (src, tag, out, plan), "recv", out, src, tag, collective=False)
        return (got, source, tag) if status else got

    def irecv(self, src: int | None = None, tag: int = 0, *, out: Array | None = None) -> Received:
        """Start a receive; return a handle whose ``wait()`` gives the array, then has ``source`` and ``tag``."""
        return self.recv(src, tag, out=out, async_op=True)

    def _recv_message(self, src, tag, out, plan):
        base = TAG_STRIDE * tag
        if self._incoming:  # immediate receives are pending: they move on while this one waits
            incoming = Incoming(self, src, base, out, True)
            incoming.wait()
            return incoming.result(), incoming.source
        header = self._recv_header
        source = self._backend.recv(header, src, base + HEADER, False)
        if plan is not None and not self._mon.debug:
            if self._recv_tail.tobytes() == plan.tail and (
                out.flags.c_contiguous if type(out) is np.ndarray else out.is_contiguous()
            ):  # into out as it is, which fits the message (its kind aside)
                if plan.receiving is not None and type(out) is np.ndarray:
                    out[...] = plan.receiving  # inline, numpy: one copy out of the header's message
                elif plan.cpu_tensor:
                    memmove(out.data_ptr(), plan.receiving_at, plan.nbytes)  # inline, CPU tensor
                else:
                    land(self, header, out, source, base, False)
                return out, source
        elif out is None and not self._mon.debug:  # a new array of what was sent
            kind, dtype, shape = self._descs.message(self._recv_row)
            result = self._p2p_array(kind, dtype, shape)
            land(self, header, result, source, base, False)
            return result, source
        target, result, error = self._prepare(header, source, base, out)
        c, back = contiguous(target)
        land(self, header, c, source, base, False)
        if error:
            raise CollectiveError(error)
        if back is not None:
            back()
        return result, source

    def _irecv_message(self, src, tag, out):
        kind = Threaded if self._backend.receives_in_threads else Incoming
        incoming = kind(self, src, TAG_STRIDE * tag, out, True)
        self._incoming.append(incoming)
        handle = Received(incoming.wait, incoming.test, incoming.result, tag)

        def arrived():
            handle.source = incoming.source

        handle.on_complete(arrived)
        return handle

    def _progressing(self, works):
        """Wait for works (backend handles) while moving pending immediate receives on.

        A peer's large message completes only once this rank has posted
        its data receive, which an immediate receive posts when its header
        comes: so waiting for anything keeps those going, as MPI would.
        """
        spins, deadline = 0, time.monotonic() + (self.timeout or float("inf"))
        while self._incoming and not all_done(works):
            for incoming in list(self._incoming):
                incoming.advance()
            spins += 1
            if spins > 100:
                time.sleep(20e-6)
                if time.monotonic() > deadline:
                    raise CollectiveTimeout(
                        timed_out(f"rank {self.rank}", "a point-to-point wait", self.timeout)
                        + f" (its peer never sent or received); last calls on this rank: {self._mon.recent()}"
                    )
        for w in works:
            if w is not None:
                w.wait()

    # -- both ways -------------------------------------------------------------------

    @overload
    def sendrecv(self, x: Array, dst: int, src: int | None = None, tag: int = 0, *, out: None = None) -> Array: ...
    @overload
    def sendrecv(self, x: Array, dst: int, src: int | None = None, tag: int = 0, *, out: ArrayT) -> ArrayT: ...

    def sendrecv(self, x: Array, dst: int, src: int | None = None, tag: int = 0, *,
                 out: Array | None = None) -> Array:
        """Send x to dst and receive from src (None: any rank) in one call; return the array received.

        Deadlock-free when every rank calls it at once (rings, halo
        exchanges): the send is started before the receive.
        """
        if self._plan(x, "sendrecv").inline and not self._mon.debug:
            # One message: of at most 4000 B on mpi, eager on every MPI measured; within
            # torch_p2p's EAGER on gloo, whose blocking sends of that size return at once.
            # So a blocking send first is safe.
            self.send(x, dst, tag)
            return self.recv(src, tag, out=out)
        sending = self.isend(x, dst, tag)
        got = self.recv(src, tag, out=out)
        sending.wait()
        return got

    # -- objects: an object travels as its pickle, a uint8 array sent with send -----------

    def send_object(self, obj: Any, dst: int, tag: int = 0) -> None:
        """Send a picklable object to rank dst (any size, over 2 GiB included)."""
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        self.send(data, dst, tag)

    @overload
    def recv_object(self, src: int | None = None, tag: int = 0, *, status: Literal[False] = False) -> Any: ...
    @overload
    def recv_object(self, src: int | None = None, tag: int = 0, *, status: Literal[True]) -> tuple[Any, int, int]: ...

    def recv_object(self, src: int | None = None, tag: int = 0, *, status: bool = False) -> Any:
        """Receive an object sent with send_object; with ``status=True`` return ``(obj, source, tag)``."""
        data, source, tag = self.recv(src, tag, status=True)
        obj = pickle.loads(data.tobytes() if is_tensor(data) else memoryview(data))
        return (obj, source, tag) if status else obj

    # -- checks and message building: peers, tags, plans, what arrives ---------------------

    def _packed(self, header, c, n):
        """One message: the header row, then c's n bytes."""
        buf = np.empty(HEADER_BYTES + n, np.uint8)
        buf[:HEADER_BYTES] = header.view(np.uint8)
        buf[HEADER_BYTES:] = self._backend.bytes_of(c)
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
        top = self._backend.max_tag // TAG_STRIDE - 1
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

    # -- debug mode: call sites and verdicts travel with the messages ----------------------

    def _send_checked(self, c, header, dst, base, async_op, n, inline):
        """Debug mode: send the header (inline data included) and the call site, then the data.

        A blocking send of more than VERDICT_AFTER bytes, which waits for the
        receiver in any MPI, first waits for the receiver's verdict and sends
        its data only if the receiver agrees: both ranks then raise a
        mismatch.  Any other send (inline, eager-sized or immediate) goes on
        without it, so debug mode never adds a wait that could deadlock a ring
        of sends; the receiver raises the mismatch, naming both call sites,
        and drains the data.
        """
        waits = not async_op and n > VERDICT_AFTER
        self._backend.send(self._packed(header, c, n) if inline else header, dst, base + HEADER, False)
        self._send_bytes(("1" if waits else "0") + caller(), dst, base + WHERE)
        if waits:
            verdict = self._recv_bytes(dst, base + VERDICT)
            if verdict:
                raise CollectiveError(verdict)
        if n and not inline:
            if async_op:
                work = self._backend.send(c, dst, base + DATA, True)
                return Handle(lambda: self._progressing([work]), lambda: all_done([work]), lambda: (c, None)[1])
            self._backend.send(c, dst, base + DATA, False)
        return Finished(None) if async_op else None

    def _send_bytes(self, text, dst, tag):
        """Send a small text message (debug mode's call sites and verdicts): its length, then its bytes."""
        data = np.frombuffer(text.encode(), np.uint8)
        self._backend.send(np.array([data.nbytes], np.int64), dst, tag, False)
        if data.nbytes:
            self._backend.send(data, dst, tag, False)

    def _recv_bytes(self, src, tag):
        """Receive a small text message (debug mode's call sites and verdicts)."""
        size = np.empty(1, np.int64)
        self._backend.recv(size, src, tag, False)
        data = np.empty(int(size[0]), np.uint8)
        if data.nbytes:
            self._backend.recv(data, src, tag, False)
        return data.tobytes().decode()
