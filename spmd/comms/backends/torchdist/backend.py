"""Every hook over a torch.distributed process group: the torch backends' general path.

:class:`TorchBackend` implements the contract with torch.distributed's
functions, which every process group takes (nccl, torch's own mpi, gloo):
uneven scatter and gathers are padded to the longest chunk and trimmed.
torch refuses a message from a rank to itself, so those wait in a
:class:`~spmd.comms.p2p.mailbox.Mailbox`; a receive from any rank looks
there first.  torch has no scan: every rank gathers the others' arrays and
reduces the ones before it (size arrays of memory, one collective).  The gloo
and nccl backends refine it: :mod:`spmd.comms.backends.torchdist.gloo`,
:mod:`spmd.comms.backends.torchdist.nccl`.
"""

import queue
import re
import secrets
import threading
import weakref

import numpy as np
import torch
import torch.distributed as dist

from spmd.errors import CollectiveError
from spmd.comms.arrays import split_rows
from spmd.comms.contract import Backend
from spmd.comms.handle import Done, Handle, after
from spmd.comms.p2p.incoming import TAG_STRIDE
from spmd.comms.p2p.mailbox import Mailbox
from spmd.comms.state.caches import Caches
from spmd.comms.backends.torchdist import stuck
from spmd.comms.backends.torchdist.arrays import (
    OPS,
    all_gather_single,
    as_kind,
    real_view,
    reduce_scatter_single,
    tensor,
)
from spmd.comms.backends.torchdist.groups import make_groups

__all__ = ["TorchBackend", "is_timeout", "EAGER"]

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


#: Blocking sends of at most this many bytes return before the receiver has the message.
EAGER = 64 << 10

#: Tag of spmd's own messages in all_to_all's point-to-point form (a multiple of TAG_STRIDE).
A2A_TAG = 0x5358

_COMBINE = {"sum": torch.add, "prod": torch.mul, "min": torch.minimum, "max": torch.maximum}
_COMBINE_BOOL = {"sum": torch.logical_or, "prod": torch.logical_and, "min": torch.logical_and,
                 "max": torch.logical_or}

class TorchBackend(Backend):
    """The hooks over a torch.distributed process group (``self._group``; None: the default group).

    Long because its one job is: every hook of the contract on torch.distributed's functions.
    """

    #: torch's point-to-point works complete only when waited for (gloo's do not when tested).
    receives_in_threads = True

    def __init__(self, name, device="cpu", group=None, ranks=None, timeout=None, store=None, caches=None):
        self.name = name
        self.device = device
        self.timeout = timeout
        self._group = group
        self._ranks = ranks  # global rank of each member, None for the world
        self._store = store  # the rendezvous store, for reports on timeouts
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.caches = caches if caches is not None else Caches(self.size)
        self._reaper = None  # the thread that waits for small sends (made at the first)
        self._mailbox = Mailbox()  # messages to this rank itself: torch refuses them
        # Every backend split from this world, released with it at finalize.
        self._family = weakref.WeakSet([self])

    # -- timeouts: where the other ranks were (through the store) ---------------

    def note_stuck(self, call, why=""):
        stuck.note(self._store, self._ranks, self.rank, call, why)

    def peers_report(self, call):
        return stuck.report(self._store, self._ranks, self.rank, self.size, call, self.timeout)

    def is_timeout(self, exc):
        return is_timeout(exc)

    def close(self):
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
        return self.caches.results.empty((kind, dtype, shape, self.device), shape, _new, kind, dtype, shape, self.device)

    def _new_like(self, t, shape):
        """Return a result tensor like t of this shape: a dropped one, or a new one."""
        return self.caches.results.empty((t.dtype, t.device, shape), shape, t.new_empty, shape)

    # -- reductions and broadcast ----------------------------------------------

    def broadcast(self, x, root, async_op):
        t, back = tensor(x)
        work = dist.broadcast(t, group=self._group, group_src=root, async_op=async_op)
        return self._go(work, lambda: self._finish(x, back), async_op)

    def all_reduce(self, x, op, async_op):
        t, back = tensor(x)
        work = dist.all_reduce(t, op=OPS[op], group=self._group, async_op=async_op)
        return self._go(work, lambda: self._finish(x, back, t if op == "avg" else None), async_op)

    def reduce(self, x, root, op, async_op):
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

    def scatter(self, parts, whole, layout, root, out, async_op):
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
                parts = list(t.chunk(self.size)) if even else split_rows(t, lengths)
            send = [real_view(self._padded(p, top)) for p in parts]
        work = dist.scatter(real_view(buf), send, group=self._group, group_src=root, async_op=async_op)

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
            return split_rows(out, lengths)
        return pieces

    def gather(self, x, lengths, root, out, async_op):
        top = max(lengths)
        if top == 0:  # nothing to move
            if self.rank != root:
                return self._done(None, async_op)
            return self._done(self._empties(x) if out is None else split_rows(out, lengths), async_op)
        send = self._padded(x, top)
        recv = self._receive_buffers(send, lengths, out) if self.rank == root else None
        wired = None if recv is None else [real_view(r) for r in recv]
        work = dist.gather(real_view(send), wired, group=self._group, group_dst=root, async_op=async_op)
        if self.rank != root:
            return self._go(work, lambda: None, async_op)
        return self._go(work, lambda: self._results(recv, lengths, x, top, out), async_op)

    def all_gather(self, x, lengths, out, async_op):
        top = max(lengths)
        if top == 0:
            return self._done(self._empties(x) if out is None else split_rows(out, lengths), async_op)
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

    def barrier(self):
        dist.barrier(group=self._group)

    def allgather_ints(self, row):
        mine = torch.from_numpy(row).to(self.device)
        out = torch.empty(self.size * row.shape[0], dtype=torch.int64, device=self.device)
        all_gather_single(out, mine, group=self._group)
        return out.cpu().numpy().reshape(self.size, -1)

    def broadcast_ints(self, ints, root):
        t = torch.from_numpy(ints)
        if self.device == "cpu":
            dist.broadcast(t, group=self._group, group_src=root)
            return ints
        moved = t.to(self.device)
        dist.broadcast(moved, group=self._group, group_src=root)
        ints[:] = moved.cpu().numpy()
        return ints

    # -- objects -------------------------------------------------------------

    def broadcast_object(self, obj, root):
        box = [obj]
        dist.broadcast_object_list(box, group=self._group, group_src=root)
        return box[0]

    def gather_object(self, obj, root):
        out = [None] * self.size if self.rank == root else None
        dist.gather_object(obj, out, group=self._group, group_dst=root)
        return out

    def all_gather_object(self, obj):
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def scatter_object(self, objs, root):
        box = [None]
        dist.scatter_object_list(box, objs, group=self._group, group_src=root)
        return box[0]

    # -- sub-communicators -----------------------------------------------------

    def split(self, color, key):
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
        mine = type(self)(self.name, self.device, group, ranks, self.timeout, self._store, self.caches.child(len(ranks)))
        mine._family = self._family
        self._family.add(mine)
        return mine

    def free(self):
        self._stop_messages()  # its sends still in flight finish first
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._family.discard(self)
        self._release()

    def _global(self, rank):
        return rank if self._ranks is None else self._ranks[rank]

    def _early(self, work, keep):
        """Wait for a small send that returned early in the reaper's thread, keeping its copy till then."""
        if self._reaper is None:
            self._reaper = _Reaper()
        self._reaper.add(work, keep)

    def _stop_messages(self):
        """Finish the small sends still in flight and stop their thread (at finalize)."""
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.stop(self.timeout)

    def _on_device(self, x):
        """x as a tensor torch.distributed can send here: sharing x's memory when it can."""
        t = tensor(x)[0]
        if t.device.type != torch.device(self.device).type:
            t = t.to(self.device)
        return real_view(t)

    # -- point to point ---------------------------------------------------------------

    def send(self, x, dst, tag, async_op):
        if dst == self.rank:
            self._mailbox.put(x, tag)
            return Handle(lambda: None, lambda: True, lambda: None) if async_op else None
        t = self._on_device(x)
        if not async_op:
            if t.numel() * t.element_size() <= EAGER:
                # Like MPI's eager sends: a small message goes as a copy, and the send
                # returns at once; a ring of blocking sends then recvs does not deadlock.
                t = t.clone()
                self._early(dist.isend(t, group=self._group, group_dst=dst, tag=tag), t)
                return None
            dist.send(t, group=self._group, group_dst=dst, tag=tag)
            return None
        work = dist.isend(t, group=self._group, group_dst=dst, tag=tag)
        return Handle(work.wait, work.is_completed, lambda: (t, None)[1])  # t stays alive until done

    def recv(self, x, src, tag, async_op):
        if src == self.rank or (src is None and self._mailbox.has(tag)):
            if not async_op:
                self._mailbox.take(x, tag, tag // TAG_STRIDE)
                return self.rank
            return Handle(lambda: self._mailbox.take(x, tag, tag // TAG_STRIDE),
                          lambda: self._mailbox.has(tag), lambda: self.rank)
        if src is None and self.name == "nccl":
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
        work = dist.irecv(real_view(buf), group=self._group, group_src=src, tag=tag)

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

    def all_to_all(self, parts, whole, sent, layout, out, async_op):
        received, trail = layout.lengths, layout.trail
        if out is not None:
            full = tensor(out)[0]
        else:
            full = self._empty(layout.kind, layout.dtype, (sum(received),) + trail)
        if parts is None:
            source = tensor(whole)[0]
        else:
            source = torch.cat([tensor(p)[0] for p in parts]) if parts else None
        pieces = split_rows(full, received)
        result = [as_kind(p, layout.kind) for p in pieces] if out is None else split_rows(out, received)
        if self.name == "gloo" and (full.is_complex() or full.dtype == torch.bool):
            return self._all_to_all_p2p(source, sent, pieces, result, async_op)
        work = dist.all_to_all_single(
            real_view(full), real_view(source), output_split_sizes=received, input_split_sizes=sent,
            group=self._group, async_op=async_op,
        )
        return self._go(work, lambda: result, async_op)

    def _all_to_all_p2p(self, source, sent, pieces, result, async_op):
        """all_to_all as point-to-point messages (dtypes gloo's all_to_all does not take)."""
        chunks = split_rows(source, sent)
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

    def reduce_scatter(self, x, lengths, op, async_op):
        t = tensor(x)[0]
        mine = t.new_empty((lengths[self.rank],) + tuple(t.shape[1:]))
        if lengths.count(lengths[0]) == self.size:
            work = reduce_scatter_single(mine, t, op=OPS[op], group=self._group, async_op=async_op)
        else:
            blocks = list(split_rows(t, lengths))
            work = dist.reduce_scatter(mine, blocks, op=OPS[op], group=self._group, async_op=async_op)

        def finish():
            if op == "avg":
                mine.div_(self.size)
            return mine.numpy() if isinstance(x, np.ndarray) else mine

        return self._go(work, finish, async_op)

    def scan(self, x, exclusive, op, async_op):
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
