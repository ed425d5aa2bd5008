"""How arrays become MPI messages: datatypes, byte views, addresses, layouts.

Helpers of the mpi backend (``spmd.comms.backends.mpi.backend``), kept apart from its
collectives.  A numpy array goes to mpi4py as itself; a torch tensor by
address (``MPI.buffer.fromaddress``), which costs a fraction of a
microsecond where ``t.numpy()`` or mpi4py's DLPack path cost several.
"""

import numpy as np
from mpi4py import MPI

from spmd.comms.arrays import is_tensor

__all__ = ["mpi_type", "direct", "as_bytes", "raw", "contig", "address", "typed",
           "kept", "row_bytes", "displs", "finish", "packer", "Packer"]

_TYPES = {}  # numpy or torch dtype -> MPI datatype, for the fast paths


def mpi_type(dtype):
    """Return the MPI datatype for a plain numeric dtype, or None (bool, bfloat16, ...)."""
    try:
        return _TYPES[dtype]
    except KeyError:
        pass
    name = str(dtype).replace("torch.", "")
    try:
        plain = np.dtype(name) if name not in ("bool", "bfloat16") else None
    except TypeError:
        plain = None
    # Numbers only: MPI also names text and dates, which no reduction takes.
    char = plain.char if plain is not None and plain.kind in "iufc" else None
    # Predefined types only: MPI's reductions are not defined on derived ones.
    found = MPI._typedict.get(char) if char else None
    _TYPES[dtype] = found
    return found


def direct(x):
    """Return an MPI buffer spec over x itself when x needs no conversion, else None.

    The fast path of the in-place collectives: a contiguous CPU array of
    a plain numeric dtype goes to MPI by address, without views or copies.
    """
    if type(x) is np.ndarray:
        if x.flags.c_contiguous and x.size and mpi_type(x.dtype) is not None:
            return x
        return None
    if is_tensor(x) and x.is_cpu and x.is_contiguous() and x.numel():
        datatype = mpi_type(x.dtype)
        if datatype is not None:
            return [MPI.buffer.fromaddress(x.data_ptr(), x.nbytes), datatype]
    return None


def as_bytes(spec):
    """Turn a direct() spec into a byte message: data movement sends bytes on every path.

    No count: for the gathers and scatter mpi4py divides the buffer's bytes by the ranks.
    """
    return [spec[0] if type(spec) is list else spec, MPI.BYTE]


def raw(a):
    """Return contiguous array or tensor a as something MPI reads by address (paired with MPI.BYTE)."""
    if type(a) is np.ndarray:
        return a
    return MPI.buffer.fromaddress(a.data_ptr(), a.nbytes)  # any dtype, no view objects


def contig(x):
    """Return x, or a contiguous copy of it; MPI reads by address, so no detach is needed."""
    if type(x) is np.ndarray:
        return x if x.flags.c_contiguous else np.ascontiguousarray(x)
    return x if x.is_contiguous() else x.detach().contiguous()


def address(a):
    """Return where contiguous array or tensor a starts (MPI.buffer: a quarter of ctypes.data's cost)."""
    return MPI.buffer(a).address if type(a) is np.ndarray else a.data_ptr()


def typed(c):
    """Return a numpy view of contiguous c for reductions, and a write-back."""
    if isinstance(c, np.ndarray):
        return c, None
    import torch

    if c.dtype == torch.bfloat16:
        wide = c.float()
        return wide.numpy(), lambda: c.copy_(wide)
    return c.numpy(), None


def finish(x, back):
    if back is not None:
        back()
    return x


def kept(result, *alive):
    """Return result; naming alive in a closure keeps those buffers until the call is done."""
    return result


def row_bytes(a, trail):
    """Return the bytes of one dim-0 row of a, whose shape after dim 0 is trail."""
    n = 1
    for d in trail:
        n *= d
    itemsize = a.itemsize if isinstance(a, np.ndarray) else a.element_size()
    return n * itemsize


def displs(counts):
    """Return the displacements of consecutive blocks of these counts."""
    out, total = [], 0
    for n in counts:
        out.append(total)
        total += n
    return out


def packer(arrays, layouts):
    """Return a Packer of these arrays, or None; layouts keeps committed datatypes (a caches.Kept).

    None unless the arrays are all numpy arrays or all CPU tensors, of one
    dtype, contiguous, and no two overlap (MPI may not receive into
    overlapping blocks).  One pass over the list: in the coalesced
    all_reduce it is the only one.
    """
    first = arrays[0]
    kind = type(first)
    if kind is not np.ndarray and not is_tensor(first):
        return None  # the general path names what is wrong
    dtype = first.dtype
    addrs, sizes = [], []
    # Two loops, not one with a check function: a call per array costs a
    # third more here (what address() does is inlined for the same reason).
    if kind is np.ndarray:
        for a in arrays:
            if type(a) is not kind or a.dtype != dtype or not a.flags.c_contiguous:
                return None
            addrs.append(MPI.buffer(a).address)
            sizes.append(a.nbytes)
    else:
        for a in arrays:
            if type(a) is not kind or a.dtype is not dtype or not a.is_cpu or not a.is_contiguous():
                return None
            addrs.append(a.data_ptr())
            sizes.append(a.nbytes)
    key = (*addrs, *sizes)
    # Committed datatypes are kept per (addresses, sizes): a training loop
    # reduces the same arrays every step, and a datatype names memory by
    # address, so the one made for these is the one that would be made again.
    layout = layouts.get(key)
    if layout is None:
        layout = _layout(addrs, sizes)
        if not layouts.put(key, layout) and layout is not False:
            return Packer(*layout, owned=True)  # not kept: freed after its unpack
    return None if layout is False else Packer(*layout)


def _layout(addrs, sizes):
    """Return (datatype over these blocks, their bytes), or False when two blocks overlap."""
    start = np.array(addrs, dtype=np.uint64)
    order = np.argsort(start, kind="stable")
    start = start[order]
    end = start + np.array(sizes, dtype=np.uint64)[order]
    if (start[1:] < end[:-1]).any():
        return False
    return MPI.BYTE.Create_hindexed(sizes, addrs).Commit(), sum(sizes)


class Packer:
    """Copies arrays scattered in memory into a flat buffer and back, in C.

    MPI moves the bytes (a send to this process itself over a datatype
    that names each array's address, from ``MPI.BOTTOM``): one call for
    200 arrays where a Python loop makes 200, at about 1 us each.
    The datatype is kept for the next call with the same layout, unless
    owned: then ``unpack`` frees it.
    """

    def __init__(self, datatype, nbytes, owned=False):
        self._type = datatype
        self.nbytes = nbytes  # of all the arrays together
        self._owned = owned

    def pack(self, flat):
        MPI.COMM_SELF.Sendrecv([MPI.BOTTOM, 1, self._type], 0, 0, [raw(flat), MPI.BYTE], 0, 0)

    def unpack(self, flat):
        MPI.COMM_SELF.Sendrecv([raw(flat), MPI.BYTE], 0, 0, [MPI.BOTTOM, 1, self._type], 0, 0)
        if self._owned:
            self._type.Free()
            self._owned = False
