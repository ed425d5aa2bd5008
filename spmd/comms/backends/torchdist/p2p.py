"""Point to point, all_to_all, reduce_scatter and scans over torch.distributed.

A mixin of :class:`~spmd.comms.backends.torchdist.base.TorchComm`: the hooks of the
contract's later families, on torch.distributed's functions (gloo and
nccl alike).  torch refuses a message from a rank to itself, so those
wait in a :class:`~spmd.comms.p2p.mailbox.Mailbox`; a receive from any rank
looks there first.  torch has no scan: every rank gathers the others'
arrays and reduces the ones before it (size arrays of memory, one
collective).
"""

import queue
import threading

import numpy as np
import torch
import torch.distributed as dist

from spmd.errors import CollectiveError
from spmd.comms.handle import Handle, after
from spmd.comms.p2p.mailbox import Mailbox
from spmd.comms.p2p.incoming import TAG_STRIDE
from spmd.comms.backends.torchdist.arrays import OPS, as_kind, reduce_scatter_single, tensor, wire

__all__ = ["TorchMessages"]

#: Blocking sends of at most this many bytes return before the receiver has the message.
EAGER = 64 << 10

#: Tag of spmd's own messages in all_to_all's point-to-point form (a multiple of TAG_STRIDE).
A2A_TAG = 0x5358

_COMBINE = {"sum": torch.add, "prod": torch.mul, "min": torch.minimum, "max": torch.maximum}
_COMBINE_BOOL = {"sum": torch.logical_or, "prod": torch.logical_and, "min": torch.logical_and,
                 "max": torch.logical_or}


class TorchMessages:
    """_send, _recv, _all_to_all, _reduce_scatter and _scan on torch.distributed."""

    #: torch's point-to-point works complete only when waited for (gloo's do not when tested).
    _receives_in_threads = True

    def _own(self, name, make):
        """This communicator's object under name, made on first use (no __init__ in a mixin)."""
        value = self.__dict__.get(name)
        if value is None:
            value = self.__dict__[name] = make()
        return value

    @property
    def _reaper(self):
        return self._own("_own_reaper", _Reaper)

    def _stop_messages(self):
        """Finish the small sends still in flight and stop their thread (at finalize)."""
        reaper = self.__dict__.pop("_own_reaper", None)
        if reaper is not None:
            reaper.stop(self.timeout)

    @property
    def _mailbox(self):
        return self._own("_own_mailbox", Mailbox)

    def _on_device(self, x):
        """x as a tensor torch.distributed can send here: sharing x's memory when it can."""
        t = tensor(x)[0]
        if t.device.type != torch.device(self.device).type:
            t = t.to(self.device)
        return wire(t)

    # -- point to point ---------------------------------------------------------------

    def _send(self, x, dst, tag, async_op):
        if dst == self.rank:
            self._mailbox.put(x, tag)
            return Handle(lambda: None, lambda: True, lambda: None) if async_op else None
        t = self._on_device(x)
        if not async_op:
            if t.numel() * t.element_size() <= EAGER:
                # Like MPI's eager sends: a small message goes as a copy, and the send
                # returns at once; a ring of blocking sends then recvs does not deadlock.
                t = t.clone()
                self._reaper.add(dist.isend(t, group=self._group, group_dst=dst, tag=tag), t)
                return None
            dist.send(t, group=self._group, group_dst=dst, tag=tag)
            return None
        work = dist.isend(t, group=self._group, group_dst=dst, tag=tag)
        return Handle(work.wait, work.is_completed, lambda: (t, None)[1])  # t stays alive until done

    def _recv(self, x, src, tag, async_op):
        if src == self.rank or (src is None and self._mailbox.has(tag)):
            if not async_op:
                self._mailbox.take(x, tag, tag // TAG_STRIDE)
                return self.rank
            return Handle(lambda: self._mailbox.take(x, tag, tag // TAG_STRIDE),
                          lambda: self._mailbox.has(tag), lambda: self.rank)
        if src is None and self.backend == "nccl":
            raise CollectiveError(
                "recv from any rank: nccl cannot receive from an unnamed rank; name src, or receive "
                "these messages on a gloo or mpi communicator"
            )
        if src is None and async_op:
            return self._any_source(x, tag)
        work, finish = self._post_recv(x, src, tag)
        if not async_op:
            work.wait()
            return finish()
        return Handle(work.wait, work.is_completed, finish)

    def _post_recv(self, x, src, tag):
        """Post torch's receive into contiguous x; return its work and what gives the source after it."""
        t = tensor(x)[0]  # x is contiguous: t shares its memory
        buf = t if t.device.type == torch.device(self.device).type else torch.empty_like(t, device=self.device)
        work = dist.irecv(wire(buf), group=self._group, group_src=src, tag=tag)

        def finish():
            if buf is not t:  # received on the device: back into x
                t.copy_(buf)
            return src if src is not None else work._source_rank()

        return work, finish

    def _any_source(self, x, tag):
        """An immediate receive from any rank: torch's is posted only when first tested or waited for,
        so a message this rank sends itself before then (kept in the mailbox) is seen."""
        state = {}

        def posted():
            if "work" not in state:
                if self._mailbox.has(tag):
                    self._mailbox.take(x, tag, tag // TAG_STRIDE)
                    state["work"], state["finish"] = None, lambda: self.rank
                else:
                    state["work"], state["finish"] = self._post_recv(x, None, tag)
            return state["work"]

        def wait():
            work = posted()
            if work is not None:
                work.wait()

        def test():
            work = posted()
            return work is None or work.is_completed()

        return Handle(wait, test, lambda: state["finish"]())

    # -- all_to_all, reduce_scatter, scans ----------------------------------------------

    def _all_to_all(self, parts, whole, sent, layout, out, async_op):
        received, trail = layout.lengths, layout.trail
        if out is not None:
            full = tensor(out)[0]
        else:
            full = self._empty(layout.kind, layout.dtype, (sum(received),) + trail)
        if parts is None:
            source = tensor(whole)[0]
        else:
            source = torch.cat([tensor(p)[0] for p in parts]) if parts else None
        pieces = self._split(full, received)
        result = [as_kind(p, layout.kind) for p in pieces] if out is None else self._split(out, received)
        if self.backend == "gloo" and (full.is_complex() or full.dtype == torch.bool):
            return self._all_to_all_p2p(source, sent, pieces, result, async_op)
        work = dist.all_to_all_single(
            wire(full), wire(source), output_split_sizes=received, input_split_sizes=sent,
            group=self._group, async_op=async_op,
        )
        return self._go(work, lambda: result, async_op)

    def _all_to_all_p2p(self, source, sent, pieces, result, async_op):
        """all_to_all as point-to-point messages (dtypes gloo's all_to_all does not take)."""
        chunks = self._split(source, sent)
        works = []
        for j in range(self.size):
            if j == self.rank:
                pieces[j].copy_(chunks[j])
                continue
            if sent[j]:
                works.append(dist.isend(chunks[j], group=self._group, group_dst=j, tag=A2A_TAG))
            if pieces[j].numel():
                works.append(dist.irecv(pieces[j], group=self._group, group_src=j, tag=A2A_TAG))
        return after(works, lambda: result, async_op)

    def _reduce_scatter(self, x, lengths, op, async_op):
        t = tensor(x)[0]
        mine = t.new_empty((lengths[self.rank],) + tuple(t.shape[1:]))
        if lengths.count(lengths[0]) == self.size:
            work = reduce_scatter_single(mine, t, op=OPS[op], group=self._group, async_op=async_op)
        else:
            blocks = list(self._split(t, lengths))
            work = dist.reduce_scatter(mine, blocks, op=OPS[op], group=self._group, async_op=async_op)

        def finish():
            if op == "avg":
                mine.div_(self.size)
            return mine.numpy() if isinstance(x, np.ndarray) else mine

        return self._go(work, finish, async_op)

    def _scan(self, x, exclusive, op, async_op):
        t = tensor(x)[0].clone()
        everyone = [torch.empty_like(t) for _ in range(self.size)]
        work = dist.all_gather(everyone, t, group=self._group, async_op=async_op)

        def finish():
            upto = everyone[: self.rank if exclusive else self.rank + 1]
            if upto:
                combine = (_COMBINE_BOOL if t.dtype == torch.bool else _COMBINE)[op]
                acc = upto[0]
                for other in upto[1:]:
                    acc = combine(acc, other)
                _copy_into(x, acc.to(t.dtype))
            return x

        return self._go(work, finish, async_op)


def _copy_into(x, t):
    """Copy tensor t's values into array x (numpy or torch, contiguous or not)."""
    c, back = tensor(x)
    with torch.no_grad():
        c.copy_(t.reshape(c.shape))
    if back is not None:
        back()


class _Reaper:
    """Waits, in a thread, for the small sends that returned early; their copies live until then."""

    def __init__(self):
        self._queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="spmd-sends", daemon=True)
        self._thread.start()

    def add(self, work, keep):
        self._queue.put((work, keep))

    def _run(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                item[0].wait()
            except Exception:  # the receiver died or timed out: its own error tells
                pass
            item = None

    def stop(self, timeout):
        self._queue.put(None)
        self._thread.join(timeout=timeout)
