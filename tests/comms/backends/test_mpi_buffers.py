"""The mpi backend's packer: which lists it takes, what it moves, and its kept datatypes.

MPI runs in a child process (a singleton world of one), so this test
process never initialises MPI itself.
"""

import pytest

from tests.support import PY, run

pytestmark = pytest.mark.unit

CHECK = r"""
import numpy as np, torch
from mpi4py import MPI
from spmd.comms.backends.mpi import buffers as mb
from spmd.comms.state.caches import Caches

caches = Caches(1)
L = caches.layouts

a, b = np.arange(6.0), np.arange(4.0) + 10
base = np.zeros(10)
# refused: MPI may not receive into overlapping blocks, nor read a strided one
assert mb.packer([a, a], L) is None, "one array twice"
assert mb.packer([base[:6], base[4:]], L) is None, "overlapping views"
assert mb.packer([a, np.zeros((4, 4))[:, ::2]], L) is None, "strided member"
assert mb.packer([a, b.astype(np.float32)], L) is None, "mixed dtypes"
assert mb.packer([a, torch.zeros(3, dtype=torch.float64)], L) is None, "numpy and torch"
assert mb.packer([torch.zeros(4), torch.zeros(4, 2).t()], L) is None, "transposed tensor"
# adjacent views of one buffer do not overlap
assert mb.packer([base[:5], base[5:]], L) is not None, "adjacent views"

# pack and unpack move every byte, in list order
p = mb.packer([a, b], L)
assert p.nbytes == a.nbytes + b.nbytes
flat = np.empty(10)
p.pack(flat)
assert flat.tolist() == a.tolist() + b.tolist(), flat
p.unpack(flat[::-1].copy())
assert a.tolist() == [13.0, 12.0, 11.0, 10.0, 5.0, 4.0] and b.tolist() == [3.0, 2.0, 1.0, 0.0], (a, b)
ts = [torch.full((3,), float(i)) for i in range(5)] + [torch.empty(0)]
tp = mb.packer(ts, L)
tflat = torch.empty(15)
tp.pack(tflat)
assert tflat.tolist() == [float(i) for i in range(5) for _ in range(3)], tflat
tp.unpack(torch.arange(15.0))
assert [t.tolist() for t in ts[:5]] == [[3.0 * i, 3.0 * i + 1, 3.0 * i + 2] for i in range(5)]

# a second call on the same layout reuses the committed datatype; so does a
# new list whose arrays sit at the same addresses with the same sizes
assert mb.packer([a, b], L)._type == p._type
assert mb.packer([a[:], b[:]], L)._type == p._type
assert mb.packer([b, a], L)._type != p._type  # another order, another layout
# beyond LIMIT layouts the kept ones are freed and the cache starts over
kept = [mb.packer([np.empty(i + 1)], L)._type for i in range(L.count + 1)]
assert len(L) <= L.count
assert kept[0] == MPI.DATATYPE_NULL, "an evicted datatype was not freed"
# clear() (at finalize) frees every kept datatype
assert kept[-1] != MPI.DATATYPE_NULL
caches.clear()
assert len(L) == 0 and kept[-1] == MPI.DATATYPE_NULL, "clear() did not free the kept datatypes"
# with the cache off nothing is kept, and the packer frees its own datatype after unpack
caches.switch("layouts", False)
own = mb.packer([a, b], L)
assert len(L) == 0 and own._type != MPI.DATATYPE_NULL
own.pack(flat)
own.unpack(flat)
assert own._type == MPI.DATATYPE_NULL and a.tolist()[0] == 13.0
print("PACKER OK")
"""


def test_the_packer_refuses_overlap_and_strides_moves_bytes_and_keeps_layouts():
    result = run([PY, "-c", CHECK], timeout=60, what="packer checks")
    assert "PACKER OK" in result.stdout, result.stdout
