"""Collectives over a torch.distributed process group (gloo or nccl)."""

import time
import weakref
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from ..errors import CollectiveError
from .arrays import contiguous
from .base import Comm, Done, Handle
from .results import POOL

__all__ = ["TorchComm"]

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "avg": dist.ReduceOp.SUM,
}


_REDUCE_OPTIONS = {}  # op -> AllreduceOptions
for _name in ("sum", "prod", "min", "max"):
    _REDUCE_OPTIONS[_name] = dist.AllreduceOptions()
    _REDUCE_OPTIONS[_name].reduceOp = _OPS[_name]
    _REDUCE_OPTIONS[_name].asyncOp = False

#: dtypes the fast path hands to the process group as they are (not complex, not
#: bool for reductions: those take torch.distributed's own conversions).
_PLAIN = frozenset((
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8,
))

#: Tag of spmd's point-to-point messages (uneven scatter and gather on gloo).
_P2P_TAG = 0x5350

# Renamed in torch 2.13; the old name warns there.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _tensor(x):
    """Return a contiguous tensor sharing x's memory where possible, and a write-back."""
    c, back = contiguous(x)
    return (torch.from_numpy(c) if isinstance(c, np.ndarray) else c), back


class TorchComm(Comm):
    """A communicator backed by a torch.distributed process group."""

    def __init__(
        self, backend, placement, device="cpu", group=None, ranks=None, timeout=None,
        monitor=None, store=None,
    ):
        self.backend = backend
        self._group = group
        self._ranks = ranks  # global rank of each member, None for the world
        self._store = store  # the rendezvous store, for reports on timeouts
        rank = dist.get_rank(group)
        size = dist.get_world_size(group)
        super().__init__(rank, size, placement, device, timeout, monitor)
        # The process group itself, for the fast path (gloo only: nccl's
        # stream handling stays with torch.distributed's functions).
        self._pg = (group if group is not None else dist.group.WORLD) if backend == "gloo" else None
        self._roots = {}  # root -> (BroadcastOptions, ReduceOptions)
        # Every communicator split from this world, released with it at finalize.
        self._family = weakref.WeakSet([self])

    def _stuck_key(self, rank):
        tag = "world" if self._ranks is None else "-".join(map(str, self._ranks))
        return f"spmd/stuck/{tag}/{rank}"

    def _note_stuck(self, fp, why=""):
        if self._store is None:
            return
        try:
            self._store.set(self._stuck_key(self.rank), f"#{fp[0]} {fp[1]} {why}".rstrip())
        except Exception:  # the store may be gone with rank 0
            pass

    def _peers_report(self, fp):
        """Ask the store where the other ranks were stuck; wait a few seconds for them."""
        if self._store is None:
            return None
        key = self._stuck_key
        try:
            self._store.set(key(self.rank), f"#{fp[0]} {fp[1]}")
            deadline = time.monotonic() + min(5.0, self.timeout or 5.0)
            while True:
                here = [r for r in range(self.size) if self._store.check([key(r)])]
                if len(here) == self.size or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            where = {r: self._store.get(key(r)).decode() for r in here}
        except Exception:  # the store itself may be gone with rank 0
            return None
        waiting = ", ".join(f"rank {r} in {w}" for r, w in sorted(where.items()))
        missing = [r for r in range(self.size) if r not in where]
        text = f"Timed out too: {waiting}"
        if missing:
            text += f"; ranks {missing} never arrived (still computing, blocked elsewhere, or dead)"
        return text

    def _close(self):
        if self._ranks is not None:
            return  # a sub-communicator ends with its world
        if dist.is_initialized():
            dist.destroy_process_group()
        # destroy_process_group does not stop a group's worker threads while
        # Python still holds the group: drop every reference, so they are
        # joined now and not during interpreter teardown, where a thread that
        # frees a tensor after the last collective aborts the process
        # ("terminate called without an active exception").
        for comm in list(self._family):
            comm._group = comm._pg = comm._store = None
            comm._roots = {}

    def _check_device(self, x, what):
        if self.backend != "nccl":
            return super()._check_device(x, what)
        if isinstance(x, np.ndarray) or x.device.type != "cuda":
            raise CollectiveError(
                f"{what} is on the CPU but the nccl backend works on CUDA tensors; "
                f"move it with torch.as_tensor(x).to(comm.device) (here {self.device}), "
                "or use the gloo or mpi backend for CPU data"
            )

    def _go(self, work, finish, async_op):
        if async_op:
            return Handle(work.wait, work.is_completed, finish)
        return finish()

    def _done(self, result, async_op):
        return Done(result) if async_op else result

    def _empty(self, kind, dtype, shape):
        """Return a result tensor: a dropped one of this kind, dtype and shape, or a new one."""
        return POOL.empty((kind, dtype, shape, self.device), shape, _new, kind, dtype, shape, self.device)

    # -- fast paths ------------------------------------------------------------
    # A blocking broadcast, reduce or all_reduce of one contiguous CPU tensor
    # (or numpy array) of a plain dtype on gloo, with debug and trace off, goes
    # straight to the process group: torch.distributed's Python wrapper checks
    # cost more than the rest of spmd's call.  Everything else takes the
    # general path.

    def _plain(self, x):
        """Return x as a tensor the process group can take as it is, else None."""
        if type(x) is torch.Tensor:
            if x.is_cpu and x.dtype in _PLAIN and x.is_contiguous():
                return x
            return None
        if type(x) is np.ndarray and x.flags.c_contiguous and x.dtype.kind in "fiu" and x.size:
            return torch.from_numpy(x)
        return None

    def _root_options(self, root):
        opts = self._roots.get(root)
        if opts is None:
            b, r = dist.BroadcastOptions(), dist.ReduceOptions()
            b.rootRank = r.rootRank = root
            b.rootTensor = r.rootTensor = 0
            b.asyncOp = r.asyncOp = False
            opts = self._roots[root] = (b, r)
        return opts

    def broadcast(self, x, root=0, async_op=False):
        pg = self._pg
        if pg is not None and not async_op and type(root) is int and 0 <= root < self.size and not self._mon.active:
            t = self._plain(x)
            if t is not None:
                return self._direct_call(x, "broadcast", root, None, pg.broadcast, t, self._root_options(root)[0])
        return super().broadcast(x, root, async_op)

    def all_reduce(self, x, op="sum", async_op=False, chunk_bytes=None):
        pg = self._pg
        if pg is not None and not (async_op or chunk_bytes is not None or self._mon.active):
            opts = _REDUCE_OPTIONS.get(op)
            t = None if opts is None else self._plain(x)
            if t is not None:
                return self._direct_call(x, "all_reduce", None, op, pg.allreduce, t, opts)
        return super().all_reduce(x, op, async_op, chunk_bytes)

    def reduce(self, x, root=0, op="sum", async_op=False):
        pg = self._pg
        if pg is not None and not async_op and type(root) is int and 0 <= root < self.size and not self._mon.active:
            t = self._plain(x) if op in _REDUCE_OPTIONS else None
            if t is not None:
                opts = self._root_options(root)[1]
                opts.reduceOp = _OPS[op]
                if self.rank != root:
                    t = t.clone()  # gloo leaves partial results in non-root buffers
                return self._direct_call(x, "reduce", root, op, pg.reduce, t, opts)
        return super().reduce(x, root, op, async_op)

    def _direct_call(self, x, name, root, op, fn, t, opts):
        """Run fn([t], opts) as this communicator's next collective and wait; return x."""
        mon = self._mon
        fp = mon.note(name, x, root, op)
        mon.busy = fp[0]
        try:
            fn([t], opts).wait()
        except RuntimeError as exc:
            self._raise_timeout(exc, fp)
        finally:
            mon.busy = 0
        return x

    # -- reductions and broadcast ----------------------------------------------

    def _broadcast(self, x, root, async_op):
        t, back = _tensor(x)
        work = dist.broadcast(t, group=self._group, group_src=root, async_op=async_op)
        return self._go(work, lambda: self._finish(x, back), async_op)

    def _all_reduce(self, x, op, async_op):
        t, back = _tensor(x)
        work = dist.all_reduce(t, op=_OPS[op], group=self._group, async_op=async_op)
        return self._go(work, lambda: self._finish(x, back, t if op == "avg" else None), async_op)

    def _reduce(self, x, root, op, async_op):
        t, back = _tensor(x)
        if self.rank != root:
            # torch's reduce leaves partial sums in non-root buffers: give it a copy.
            t, back = t.clone(), None
        work = dist.reduce(t, op=_OPS[op], group=self._group, group_dst=root, async_op=async_op)
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
    # buffer; unequal ones are padded to the longest and trimmed after.  On
    # gloo the process group is called directly, as in the fast paths.

    def _scatter(self, parts, whole, header, root, async_op):
        if self.backend == "gloo":
            return self._scatter_p2p(parts, whole, header, root, async_op)
        lengths, trail, kind, given = header["lengths"], header["trail"], header["kind"], header["out"]
        top, mine = max(lengths), lengths[self.rank]
        if given is not None and mine == top:
            buf = _tensor(given)[0]  # receive into out itself
        else:
            buf = self._empty(kind, header["dtype"], (top,) + trail)
        if top == 0:
            return self._done(given if given is not None else _as_kind(buf, kind), async_op)
        send = None
        if self.rank == root:
            if parts is None:
                t = _tensor(whole)[0]
                even = lengths.count(top) == self.size
                parts = list(t.chunk(self.size)) if even else self._split(t, lengths)
            send = [self._padded(p, top) for p in parts]
        work = dist.scatter(buf, send, group=self._group, group_src=root, async_op=async_op)

        def finish():
            if given is None:
                return _as_kind(buf if mine == top else buf[:mine], kind)
            if mine != top:
                _tensor(given)[0].copy_(buf[:mine])
            return given

        return self._go(work, finish, async_op)

    # On gloo, scatter and gather go point to point: no padding of unequal
    # chunks, and 1.3-2x faster than gloo's own scatter and gather at every
    # size measured here (docs/performance.md).

    def _scatter_p2p(self, parts, whole, header, root, async_op):
        lengths, kind, given = header["lengths"], header["kind"], header["out"]
        mine = lengths[self.rank]
        if given is not None:
            out = _tensor(given)[0]
        else:
            out = self._empty(kind, header["dtype"], (mine,) + header["trail"])
        works = []
        if self.rank == root:
            if parts is None:
                parts = self._split(_tensor(whole)[0], lengths)
            for i, part in enumerate(parts):
                t = _tensor(part)[0]
                if i == root:
                    out.copy_(t)
                elif lengths[i]:
                    works.append(dist.isend(t, group=self._group, group_dst=i, tag=_P2P_TAG))
        elif mine:
            works.append(dist.irecv(out, group=self._group, group_src=root, tag=_P2P_TAG))
        result = given if given is not None else _as_kind(out, kind)
        return self._after(works, lambda: result, async_op)

    def _gather_p2p(self, x, lengths, root, out, async_op):
        t = _tensor(x)[0]
        if self.rank != root:
            works = [dist.isend(t, group=self._group, group_dst=root, tag=_P2P_TAG)] if lengths[self.rank] else []
            return self._after(works, lambda: None, async_op)
        full = _tensor(out)[0] if out is not None else _new_like(t, (sum(lengths),) + tuple(t.shape[1:]))
        pieces = self._split(full, lengths)
        works = []
        for i, piece in enumerate(pieces):
            if i == root:
                piece.copy_(t)
            elif lengths[i]:
                works.append(dist.irecv(piece, group=self._group, group_src=i, tag=_P2P_TAG))
        numpy = type(x) is np.ndarray
        return self._after(works, lambda: [p.numpy() for p in pieces] if numpy else pieces, async_op)

    @staticmethod
    def _after(works, finish, async_op):
        """Wait for point-to-point works (or hand back a handle) and finish."""
        if async_op:
            return Handle(lambda: [w.wait() for w in works],
                          lambda: all(w.is_completed() for w in works), finish)
        for w in works:
            w.wait()
        return finish()

    def _padded(self, x, rows):
        t, _ = _tensor(x)
        if t.shape[0] == rows:
            return t
        out = t.new_zeros((rows,) + tuple(t.shape[1:]))
        out[: t.shape[0]] = t
        return out

    def _receive_buffers(self, send, lengths, out):
        """Return views of one buffer, one per rank's padded chunk (out itself when it fits)."""
        if out is not None and lengths.count(send.shape[0]) == self.size:
            full = _tensor(out)[0]
        else:
            full = _new_like(send, (self.size * send.shape[0],) + tuple(send.shape[1:]))
        return list(full.chunk(self.size))

    def _results(self, recv, lengths, x, top, out):
        """Every rank's chunk, trimmed; copied into out unless received there."""
        pieces = self._trim(recv, lengths, x, top)
        if out is None:
            return pieces
        if top * self.size != sum(lengths):  # received padded: copy into out
            torch.cat([_tensor(p)[0] for p in pieces], out=_tensor(out)[0])
            return self._split(out, lengths)
        return pieces

    def _gather(self, x, lengths, root, async_op, out):
        if self.backend == "gloo":
            return self._gather_p2p(x, lengths, root, out, async_op)
        top = max(lengths)
        if top == 0:  # nothing to move
            if self.rank != root:
                return self._done(None, async_op)
            return self._done(self._empties(x) if out is None else self._split(out, lengths), async_op)
        send = self._padded(x, top)
        recv = self._receive_buffers(send, lengths, out) if self.rank == root else None
        work = dist.gather(send, recv, group=self._group, group_dst=root, async_op=async_op)
        if self.rank != root:
            return self._go(work, lambda: None, async_op)
        return self._go(work, lambda: self._results(recv, lengths, x, top, out), async_op)

    def _all_gather(self, x, lengths, async_op, out):
        top = max(lengths)
        if top == 0:
            return self._done(self._empties(x) if out is None else self._split(out, lengths), async_op)
        send = self._padded(x, top)
        recv = self._receive_buffers(send, lengths, out)
        if self._direct(send):
            opts = AllgatherOptions()
            opts.asyncOp = async_op
            work = self._wait(self._pg.allgather([recv], [send], opts), async_op)
        else:
            work = dist.all_gather(recv, send, group=self._group, async_op=async_op)
        return self._go(work, lambda: self._results(recv, lengths, x, top, out), async_op)

    def _empties(self, x):
        """Every rank's chunk when all are empty: new empty arrays like x."""
        t = _tensor(x)[0]
        out = [t.new_empty(t.shape) for _ in range(self.size)]
        return [o.numpy() for o in out] if type(x) is np.ndarray else out

    def _direct(self, t):
        """Tell whether t may go straight to the process group (gloo, plain dtype)."""
        return self._pg is not None and t.dtype in _PLAIN

    @staticmethod
    def _wait(work, async_op):
        if not async_op:
            work.wait()
        return work

    @staticmethod
    def _trim(recv, lengths, like, top):
        if type(like) is np.ndarray:
            return [(t if n == top else t[:n]).numpy() for t, n in zip(recv, lengths)]
        return [t if n == top else t[:n] for t, n in zip(recv, lengths)]

    def _barrier(self):
        dist.barrier(group=self._group)

    def _allgather_ints(self, row):
        if self._pg is not None:
            out = torch.empty((self.size, row.shape[0]), dtype=torch.int64)
            self._pg.allgather([list(out.unbind(0))], [torch.from_numpy(row)], AllgatherOptions()).wait()
            return out.numpy()
        mine = torch.from_numpy(row).to(self.device)
        out = torch.empty(self.size * row.shape[0], dtype=torch.int64, device=self.device)
        _all_gather_single(out, mine, group=self._group)
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
        pairs = self.all_gather_object((color, key))
        mine = None
        for c in sorted({c for c, _ in pairs if c is not None}):
            members = sorted((k, r) for r, (cc, k) in enumerate(pairs) if cc == c)
            ranks = [self._global(r) for _, r in members]
            # Every rank creates every group, in the same order, as torch requires.
            group = dist.new_group(ranks, timeout=timedelta(seconds=self.timeout), sort_ranks=False)
            if c == color:
                mine = TorchComm(
                    self.backend, self.placement, self.device, group, ranks, self.timeout,
                    self._mon.child(), self._store,
                )
                mine._family = self._family
                self._family.add(mine)
        return mine

    def _global(self, rank):
        return rank if self._ranks is None else self._ranks[rank]


def _new(kind, dtype, shape, device):
    if kind == "numpy":
        return torch.from_numpy(np.empty(shape, dtype=dtype))
    return torch.empty(shape, dtype=getattr(torch, dtype), device=device)


def _new_like(t, shape):
    """Return a result tensor like t of this shape: a dropped one, or a new one."""
    return POOL.empty((t.dtype, t.device, shape), shape, t.new_empty, shape)


def _as_kind(t, kind):
    return t.numpy() if kind == "numpy" else t


def init_process_group(backend, store, rank, size, timeout, device):
    """Start torch.distributed's default group over a store (None: MPI meets by itself)."""
    kwargs = {"timeout": timedelta(seconds=timeout)}
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=size)
    if backend == "nccl":
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(backend, **kwargs)
