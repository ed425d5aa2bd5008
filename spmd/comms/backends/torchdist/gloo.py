"""The gloo backend: torch.distributed's gloo process group, called directly where it pays.

On top of :class:`~spmd.comms.backends.torchdist.backend.TorchBackend`: direct
hooks for broadcast, reduce and all_reduce; scatter, gather and a blocking
reduce (up a binomial tree) point to point; all_gather and the description
exchange on the process group's allgather.  Why, with the measurements:
docs/comms.md, "The gloo backend".
"""

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from spmd.comms.arrays import split_rows
from spmd.comms.handle import after
from spmd.comms.p2p.incoming import HEADER_BYTES
from spmd.comms.backends.torchdist.arrays import OPS, as_kind, tensor
from spmd.comms.backends.torchdist.backend import EAGER, TorchBackend

__all__ = ["GlooBackend", "P2P_TAG"]

_REDUCE_OPTIONS = {}  # op -> AllreduceOptions
for _name in ("sum", "prod", "min", "max"):
    _REDUCE_OPTIONS[_name] = dist.AllreduceOptions()
    _REDUCE_OPTIONS[_name].reduceOp = OPS[_name]
    _REDUCE_OPTIONS[_name].asyncOp = False

#: dtypes the direct hooks hand to the process group as they are (not complex,
#: not bool for reductions: those take torch.distributed's own conversions).
_PLAIN = frozenset((
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8,
))

#: Tag of spmd's point-to-point messages (scatter, gather and reduce).
P2P_TAG = 0x5350

#: A reduce's tensor larger than this goes in pieces (at most four), so the
#: receiver combines one piece while the next arrives.
PIECE_BYTES = 4 << 20

#: op -> combine(acc, incoming, out): out = acc (op) incoming, elementwise.
_COMBINE = {
    "sum": lambda a, b, out: torch.add(a, b, out=out),
    "prod": lambda a, b, out: torch.mul(a, b, out=out),
    "min": lambda a, b, out: torch.minimum(a, b, out=out),
    "max": lambda a, b, out: torch.maximum(a, b, out=out),
}


def _plain(x):
    """Return x as a tensor the process group can take as it is, else None."""
    if type(x) is torch.Tensor:
        if x.is_cpu and x.dtype in _PLAIN and x.is_contiguous():
            return x
        return None
    if type(x) is np.ndarray and x.flags.c_contiguous and x.dtype.kind in "fiu" and x.size:
        return torch.from_numpy(x)
    return None


def _run(fn, t, opts):
    """Run fn([t], opts) on the process group and wait for it."""
    fn([t], opts).wait()


class GlooBackend(TorchBackend):
    """The hooks over a gloo process group."""

    #: gloo receives a message shorter than its buffer (nccl does not), so point-to-point data
    #: up to this size travels inside its header's message (spmd.comms.p2p.methods): one message, not
    #: two.  Up to torch_p2p's EAGER (64 KiB, header included), the size below which blocking
    #: sends return at once: each further gloo message cost about 450 us here.
    inline_bytes = EAGER - HEADER_BYTES

    def __init__(self, name="gloo", device="cpu", group=None, ranks=None, timeout=None, store=None, caches=None):
        super().__init__(name, device, group, ranks, timeout, store, caches)
        self._pg = group if group is not None else dist.group.WORLD  # the process group object
        self._roots = {}  # root -> BroadcastOptions

    def _release(self):
        super()._release()
        self._pg, self._roots = None, {}

    # -- direct hooks ----------------------------------------------------------

    def _broadcast_options(self, root):
        opts = self._roots.get(root)
        if opts is None:
            opts = self._roots[root] = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor, opts.asyncOp = root, 0, False
        return opts

    def direct_broadcast(self, x, root):
        t = _plain(x)
        if t is None or self._pg is None:
            return None
        return _run, (self._pg.broadcast, t, self._broadcast_options(root))

    def direct_all_reduce(self, x, op):
        opts = _REDUCE_OPTIONS.get(op) if type(op) is str else None
        t = None if opts is None else _plain(x)
        if t is None or self._pg is None:
            return None
        return _run, (self._pg.allreduce, t, opts)

    def direct_reduce(self, x, root, op):
        t = _plain(x) if type(op) is str and op in _COMBINE else None
        if t is None or self._pg is None:
            return None
        return self._tree_reduce, (t, root, _COMBINE[op])

    def reduce(self, x, root, op, async_op):
        t = None if async_op or self._pg is None else _plain(x)
        if t is None or op not in _COMBINE and op != "avg":
            return super().reduce(x, root, op, async_op)
        self._tree_reduce(t, root, _COMBINE["sum" if op == "avg" else op])
        if op == "avg" and self.rank == root:
            t.div_(self.size)
        return self._done(x, async_op)

    def _tree_reduce(self, t, root, combine):
        """Reduce t into root's t up a binomial tree of sends; other ranks' t unchanged.

        Rank r (counted from root) receives from r + 1, r + 2, r + 4, ...
        while those exist and r has not the bit set, then sends what it holds
        to r minus its lowest set bit.  A leaf sends its own t: no copy.
        """
        size, n = self.size, t.numel()
        if size == 1 or n == 0:
            return
        flat = t.view(-1)
        step = max(PIECE_BYTES // t.element_size(), -(-n // 4))
        pieces = [slice(i, min(n, i + step)) for i in range(0, n, step)]
        rel, mask, acc, scratch = (self.rank - root) % size, 1, flat, None
        while mask < size:
            if rel & mask:
                dst = (rel - mask + root) % size
                works = [dist.isend(acc[p], group=self._group, group_dst=dst, tag=P2P_TAG) for p in pieces]
                for w in works:
                    w.wait()
                return
            if rel + mask < size:
                src = (rel + mask + root) % size
                if scratch is None:
                    scratch = self._new_like(flat, flat.shape)
                left, into = acc, acc
                if acc is flat and self.rank != root:  # keep this rank's input as it was
                    into = acc = self._new_like(flat, flat.shape)
                works = [dist.irecv(scratch[p], group=self._group, group_src=src, tag=P2P_TAG)
                         for p in pieces]
                for p, w in zip(pieces, works):
                    w.wait()
                    combine(left[p], scratch[p], into[p])
            mask <<= 1

    # -- scatter and gather, point to point ----------------------------------------

    def scatter(self, parts, whole, layout, root, out, async_op):
        lengths, kind = layout.lengths, layout.kind
        mine = lengths[self.rank]
        if out is not None:
            got = tensor(out)[0]
        else:
            got = self._empty(kind, layout.dtype, (mine,) + layout.trail)
        works = []
        if self.rank == root:
            if parts is None:
                parts = split_rows(tensor(whole)[0], lengths)
            for i, part in enumerate(parts):
                t = tensor(part)[0]
                if i == root:
                    got.copy_(t)
                elif lengths[i]:
                    works.append(dist.isend(t, group=self._group, group_dst=i, tag=P2P_TAG))
        elif mine:
            works.append(dist.irecv(got, group=self._group, group_src=root, tag=P2P_TAG))
        result = out if out is not None else as_kind(got, kind)
        return after(works, lambda: result, async_op)

    def gather(self, x, lengths, root, out, async_op):
        t = tensor(x)[0]
        if self.rank != root:
            works = [dist.isend(t, group=self._group, group_dst=root, tag=P2P_TAG)] if lengths[self.rank] else []
            return after(works, lambda: None, async_op)
        full = tensor(out)[0] if out is not None else self._new_like(t, (sum(lengths),) + tuple(t.shape[1:]))
        pieces = split_rows(full, lengths)
        works = []
        for i, piece in enumerate(pieces):
            if i == root:
                piece.copy_(t)
            elif lengths[i]:
                works.append(dist.irecv(piece, group=self._group, group_src=i, tag=P2P_TAG))
        numpy = type(x) is np.ndarray
        return after(works, lambda: [p.numpy() for p in pieces] if numpy else pieces, async_op)

    # -- all_gather and descriptions on the process group itself -------------------

    def _all_gather_work(self, recv, send, async_op):
        if self._pg is None or send.dtype not in _PLAIN:
            return super()._all_gather_work(recv, send, async_op)
        opts = AllgatherOptions()
        opts.asyncOp = async_op
        work = self._pg.allgather([recv], [send], opts)
        if not async_op:
            work.wait()
        return work

    def allgather_ints(self, row):
        if self._pg is None:
            return super().allgather_ints(row)
        out = torch.empty((self.size, row.shape[0]), dtype=torch.int64)
        self._pg.allgather([list(out.unbind(0))], [torch.from_numpy(row)], AllgatherOptions()).wait()
        return out.numpy()
