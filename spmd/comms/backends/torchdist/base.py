"""Collectives over a torch.distributed process group: the general path of every torch backend.

:class:`TorchComm` implements the contract with torch.distributed's
functions, which every process group takes (nccl, torch's own mpi, gloo);
uneven scatter and gathers are padded to the longest chunk and trimmed.
The gloo and nccl backends refine it: :mod:`spmd.comms.backends.torchdist.gloo`,
:mod:`spmd.comms.backends.torchdist.nccl`.
"""

import re
import secrets
import weakref

import numpy as np
import torch
import torch.distributed as dist

from spmd.comms.backends.torchdist import stuck
from spmd.comms.base import Comm
from spmd.comms.handle import Done, Handle
from spmd.comms.backends.torchdist.arrays import OPS, all_gather_single, as_kind, tensor, wire
from spmd.comms.backends.torchdist.groups import make_groups
from spmd.comms.backends.torchdist.p2p import TorchMessages

__all__ = ["TorchComm", "is_timeout"]

#: How torch's backends and store word their own timeouts (torch 2.13): gloo's transport,
#: '[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 6000ms for recv operation
#: to complete', and, at the next call on a pair that a timeout closed, 'Application timeout
#: caused pair closure' (both plain RuntimeErrors); nccl's watchdog, '[Rank 0] Watchdog caught
#: collective operation timeout: WorkNCCL(...)'; the store (DistStoreError), 'wait timeout
#: after 6000ms, keys: ...'.  Each at the start of the message, after gloo's '[file:line] '.
_TIMEOUT = re.compile(
    r"(?:\[[^\]\n]*\] )?(?:Timed out waiting \d+ms for (?:recv|send) operation"
    r"|Application timeout caused pair closure|Watchdog caught collective operation timeout"
    r"|wait timeout after \d+ms|barrier timeout after \d+ms|Socket Timeout|Wait timeout)"
)


def is_timeout(exc):
    """Tell whether exc, raised by torch.distributed, is its backend's or store's own timeout."""
    return (type(exc) is RuntimeError or isinstance(exc, dist.DistError)) and _TIMEOUT.match(str(exc)) is not None


def _new(kind, dtype, shape, device):
    if kind == "numpy":
        return torch.from_numpy(np.empty(shape, dtype=dtype))
    return torch.empty(shape, dtype=getattr(torch, dtype), device=device)


class TorchComm(TorchMessages, Comm):
    """A communicator backed by a torch.distributed process group."""

    def __init__(
        self, backend, placement, device="cpu", group=None, ranks=None, timeout=None,
        monitor=None, store=None, caches=None,
    ):
        self.backend = backend
        self._group = group
        self._ranks = ranks  # global rank of each member, None for the world
        self._store = store  # the rendezvous store, for reports on timeouts
        rank = dist.get_rank(group)
        size = dist.get_world_size(group)
        super().__init__(rank, size, placement, device, timeout, monitor, caches)
        # Every communicator split from this world, released with it at finalize.
        self._family = weakref.WeakSet([self])

    # -- timeouts: where the other ranks were (through the store) ---------------

    def _note_stuck(self, call, why=""):
        stuck.note(self._store, self._ranks, self.rank, call, why)

    def _peers_report(self, call):
        return stuck.report(self._store, self._ranks, self.rank, self.size, call, self.timeout)

    def _is_timeout(self, exc):
        return is_timeout(exc)

    def _close(self):
        if self._ranks is not None:
            return  # a sub-communicator ends with its world
        # destroy_process_group does not stop a group's worker threads while
        # Python still holds the group: drop every reference, so they are
        # joined now and not during interpreter teardown, where a thread that
        # frees a tensor after the last collective aborts the process
        # ("terminate called without an active exception").
        for comm in list(self._family):
            comm._stop_messages()  # before the group goes: its sends still in flight finish
        if dist.is_initialized():
            dist.destroy_process_group()
        for comm in list(self._family):
            comm._release()

    def _release(self):
        """Drop this communicator's references to its process group and store."""
        self._group = self._store = None

    # -- helpers -----------------------------------------------------------------

    @staticmethod
    def _go(work, finish, async_op):
        if async_op:
            return Handle(work.wait, work.is_completed, finish)
        return finish()

    @staticmethod
    def _done(result, async_op):
        return Done(result) if async_op else result

    def _empty(self, kind, dtype, shape):
        """Return a result tensor: a dropped one of this kind, dtype and shape, or a new one."""
        return self._caches.results.empty((kind, dtype, shape, self.device), shape, _new, kind, dtype, shape, self.device)

    def _new_like(self, t, shape):
        """Return a result tensor like t of this shape: a dropped one, or a new one."""
        return self._caches.results.empty((t.dtype, t.device, shape), shape, t.new_empty, shape)

    # -- reductions and broadcast ----------------------------------------------

    def _broadcast(self, x, root, async_op):
        t, back = tensor(x)
        work = dist.broadcast(t, group=self._group, group_src=root, async_op=async_op)
        return self._go(work, lambda: self._finish(x, back), async_op)

    def _all_reduce(self, x, op, async_op):
        t, back = tensor(x)
        work = dist.all_reduce(t, op=OPS[op], group=self._group, async_op=async_op)
        return self._go(work, lambda: self._finish(x, back, t if op == "avg" else None), async_op)

    def _reduce(self, x, root, op, async_op):
        t, back = tensor(x)
        if self.rank != root:
            # torch's reduce leaves partial sums in non-root buffers: give it a copy.
            t, back = t.clone(), None
        work = dist.reduce(t, op=OPS[op], group=self._group, group_dst=root, async_op=async_op)
        avg = t if op == "avg" and self.rank == root else None
        return self._go(work, lambda: self._finish(x, back, avg), async_op)

    def _finish(self, x, back, average=None):
        if average is not None:
            average.div_(self.size)
        if back is not None:
            back()
        return x

    # -- scatter and gathers -----------------------------------------------------
    # Chunks of equal length go as they are, received into views of one
    # buffer; unequal ones are padded to the longest and trimmed after.

    def _scatter(self, parts, whole, layout, root, out, async_op):
        lengths, trail, kind = layout.lengths, layout.trail, layout.kind
        top, mine = max(lengths), lengths[self.rank]
        if out is not None and mine == top:
            buf = tensor(out)[0]  # receive into out itself
        else:
            buf = self._empty(kind, layout.dtype, (top,) + trail)
        if top == 0:
            return self._done(out if out is not None else as_kind(buf, kind), async_op)
        send = None
        if self.rank == root:
            if parts is None:
                t = tensor(whole)[0]
                even = lengths.count(top) == self.size
                parts = list(t.chunk(self.size)) if even else self._split(t, lengths)
            send = [wire(self._padded(p, top)) for p in parts]
        work = dist.scatter(wire(buf), send, group=self._group, group_src=root, async_op=async_op)

        def finish():
            if out is None:
                return as_kind(buf if mine == top else buf[:mine], kind)
            if mine != top:
                tensor(out)[0].copy_(buf[:mine])
            return out

        return self._go(work, finish, async_op)

    def _padded(self, x, rows):
        t, _ = tensor(x)
        if t.shape[0] == rows:
            return t
        out = t.new_zeros((rows,) + tuple(t.shape[1:]))
        out[: t.shape[0]] = t
        return out

    def _receive_buffers(self, send, lengths, out):
        """Return views of one buffer, one per rank's padded chunk (out itself when it fits)."""
        if out is not None and lengths.count(send.shape[0]) == self.size:
            full = tensor(out)[0]
        else:
            full = self._new_like(send, (self.size * send.shape[0],) + tuple(send.shape[1:]))
        return list(full.chunk(self.size))

    def _results(self, recv, lengths, x, top, out):
        """Every rank's chunk, trimmed; copied into out unless received there."""
        pieces = self._trim(recv, lengths, x, top)
        if out is None:
            return pieces
        if top * self.size != sum(lengths):  # received padded: copy into out
            torch.cat([tensor(p)[0] for p in pieces], out=tensor(out)[0])
            return self._split(out, lengths)
        return pieces

    def _gather(self, x, lengths, root, out, async_op):
        top = max(lengths)
        if top == 0:  # nothing to move
            if self.rank != root:
                return self._done(None, async_op)
            return self._done(self._empties(x) if out is None else self._split(out, lengths), async_op)
        send = self._padded(x, top)
        recv = self._receive_buffers(send, lengths, out) if self.rank == root else None
        wired = None if recv is None else [wire(r) for r in recv]
        work = dist.gather(wire(send), wired, group=self._group, group_dst=root, async_op=async_op)
        if self.rank != root:
            return self._go(work, lambda: None, async_op)
        return self._go(work, lambda: self._results(recv, lengths, x, top, out), async_op)

    def _all_gather(self, x, lengths, out, async_op):
        top = max(lengths)
        if top == 0:
            return self._done(self._empties(x) if out is None else self._split(out, lengths), async_op)
        send = self._padded(x, top)
        recv = self._receive_buffers(send, lengths, out)
        work = self._all_gather_work(recv, send, async_op)
        return self._go(work, lambda: self._results(recv, lengths, x, top, out), async_op)

    def _all_gather_work(self, recv, send, async_op):
        """Start the all_gather of send into the list recv; return its work (waited for unless async_op)."""
        return dist.all_gather(recv, send, group=self._group, async_op=async_op)

    def _empties(self, x):
        """Every rank's chunk when all are empty: new empty arrays like x."""
        t = tensor(x)[0]
        out = [t.new_empty(t.shape) for _ in range(self.size)]
        return [o.numpy() for o in out] if type(x) is np.ndarray else out

    @staticmethod
    def _trim(recv, lengths, like, top):
        if type(like) is np.ndarray:
            return [(t if n == top else t[:n]).numpy() for t, n in zip(recv, lengths)]
        return [t if n == top else t[:n] for t, n in zip(recv, lengths)]

    def _barrier(self):
        dist.barrier(group=self._group)

    def _allgather_ints(self, row):
        mine = torch.from_numpy(row).to(self.device)
        out = torch.empty(self.size * row.shape[0], dtype=torch.int64, device=self.device)
        all_gather_single(out, mine, group=self._group)
        return out.cpu().numpy().reshape(self.size, -1)

    def _broadcast_ints(self, ints, root):
        t = torch.from_numpy(ints)
        if self.device == "cpu":
            dist.broadcast(t, group=self._group, group_src=root)
            return ints
        moved = t.to(self.device)
        dist.broadcast(moved, group=self._group, group_src=root)
        ints[:] = moved.cpu().numpy()
        return ints

    # -- objects -------------------------------------------------------------

    def _broadcast_object(self, obj, root):
        box = [obj]
        dist.broadcast_object_list(box, group=self._group, group_src=root)
        return box[0]

    def _gather_object(self, obj, root):
        out = [None] * self.size if self.rank == root else None
        dist.gather_object(obj, out, group=self._group, group_dst=root)
        return out

    def _all_gather_object(self, obj):
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def _scatter_object(self, objs, root):
        box = [None]
        dist.scatter_object_list(box, objs, group=self._group, group_src=root)
        return box[0]

    # -- sub-communicators -----------------------------------------------------

    def _split_comm(self, color, key):
        said = self.all_gather_object((color, key, secrets.token_hex(8)))
        pairs = [(c, k) for c, k, _ in said]
        groups = {}
        for c in sorted({c for c, _ in pairs if c is not None}):
            members = sorted((k, r) for r, (cc, k) in enumerate(pairs) if cc == c)
            groups[c] = [self._global(r) for _, r in members]
        group = make_groups(self, self._store, said[0][2], list(groups.values()), self.timeout)
        if color is None:
            return None
        ranks = groups[color]
        mine = type(self)(
            self.backend, self.placement, self.device, group, ranks, self.timeout,
            self._mon.child(), self._store, self._caches.child(len(ranks)),
        )
        mine._family = self._family
        self._family.add(mine)
        return mine

    def _free(self):
        self._stop_messages()  # its sends still in flight finish first
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._family.discard(self)
        self._mon.forget()
        self._caches.clear()
        self._release()

    def _global(self, rank):
        return rank if self._ranks is None else self._ranks[rank]
