"""The caches a communicator owns: bounds, switches, sharing with sub-communicators, and the end at finalize."""

import numpy as np
import pytest
import torch

import spmd
from spmd.comms.state.caches import FLAT_COUNT, NAMES, Caches, Kept
from spmd.comms.state.results import MIN_ITEMS, Results

pytestmark = pytest.mark.unit

N = MIN_ITEMS
KEY = ("torch", torch.float32, (N,))


def test_kept_is_bounded_in_count_and_bytes_and_releases_what_it_lets_go():
    released = []
    kept = Kept(2, 100, release=released.append)
    assert kept.put("a", "A", 40) and kept.put("b", "B", 40)
    assert kept.put("c", "C", 40)  # a third: the table starts over
    assert released == ["A", "B"] and len(kept) == 1 and kept.nbytes == 40
    assert kept.put("d", "D", 70)  # 110 bytes would pass the bound: starts over
    assert kept.get("c") is None and kept.get("d") == "D" and kept.nbytes == 70
    assert not kept.put("e", "E", 101)  # larger than the bound: never kept
    assert kept.get("e") is None and kept.get("d") == "D"
    kept.clear()
    assert released == ["A", "B", "C", "D"] and kept.nbytes == 0
    off = Kept(0)
    assert not off.put("a", "A") and off.get("a") is None


def test_every_cache_can_be_switched_off_and_on():
    caches = Caches(2)
    for name in NAMES:
        assert caches.on(name)
        caches.switch(name, False)
        assert not caches.on(name)
    assert not caches.flat.put("k", np.empty(8), 64)
    assert caches.results.empty(KEY, (N,), torch.empty, N) is not None and caches.results.nbytes == 0
    row = caches.descs.row(np.empty((3, 2)))
    assert caches.descs._rows == {} and row[1] is not None
    for name in NAMES:
        caches.switch(name, True)
    assert caches.flat.put("k", np.empty(8), 64) and caches.flat.count == FLAT_COUNT
    with pytest.raises(spmd.SettingsError, match="unknown cache 'pool'"):
        caches.switch("pool", True)


def test_sub_communicators_share_the_results_pool_and_end_with_their_world():
    world = Caches(4)
    sub = world.child(2)
    assert sub.results is world.results and sub.descs is not world.descs and sub.descs.size == 2
    sub.flat.put("k", np.empty(4), 32)
    held = sub.results.empty(KEY, (N,), torch.empty, N)
    assert world.results.nbytes == N * 4 and sub.flat.nbytes == 32
    world.clear()
    assert world.results.nbytes == 0 and sub.flat.nbytes == 0 and len(sub.flat) == 0
    del held
    world.switch("flat", False)
    assert not world.child(2).on("flat")  # a sub-communicator follows its world's switches


def test_a_comm_owns_its_caches_and_clear_frees_everything_it_kept():
    from mpi4py import MPI

    from spmd.comms.backends.mpi.backend import MpiBackend
    from spmd.comms.comm import Comm

    comm = Comm(MpiBackend(MPI.COMM_SELF))
    xs = [np.ones(100) for _ in range(4)]
    comm.all_reduce(xs)  # packer layout and flat buffer kept
    got = comm.all_gather(np.ones((N, 2)))  # a large result: kept by the pool
    assert len(comm._caches.layouts) == 1 and len(comm._caches.flat) == 1
    assert comm._caches.results.nbytes == N * 2 * 8
    sub = comm.split(0)
    assert sub._caches.results is comm._caches.results
    sub.all_reduce([np.ones(3), np.ones(2)])
    assert len(sub._caches.flat) == 1
    comm._caches.clear()
    assert comm._caches.nbytes == 0 and len(comm._caches.layouts) == 0 and len(sub._caches.flat) == 0
    del got


# -- the results pool and memory held from C++ --------------------------------------------------

def _pool_tensor(pool):
    return pool.empty(KEY, (N,), torch.empty, N)


def test_a_tensor_saved_by_autograd_is_never_handed_out_while_the_graph_holds_it():
    pool = Results(limit=1 << 30)
    t = _pool_tensor(pool).fill_(2.0)
    w = torch.ones(N, requires_grad=True)
    loss = (t * w).sum()  # autograd saves t for the gradient of w
    kept = id(t)
    del t
    again = _pool_tensor(pool)
    assert id(again) != kept
    again.fill_(5.0)  # were it t's memory, backward would read 5s
    loss.backward()
    assert torch.equal(w.grad, torch.full((N,), 2.0))
    del loss, again
    assert id(_pool_tensor(pool)) == kept  # the graph is gone: the buffer comes back


def test_a_dlpack_export_holds_the_buffer():
    pool = Results(limit=1 << 30)
    for export in (torch.utils.dlpack.to_dlpack, np.from_dlpack):
        t = _pool_tensor(pool).fill_(1.0)
        kept = id(t)
        held = export(t)
        del t
        assert id(_pool_tensor(pool)) != kept, export
        del held
        assert id(_pool_tensor(pool)) == kept, export
        pool.clear()


def test_the_pool_keeps_no_tensor_where_torch_has_no_storage_use_count(monkeypatch):
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    pool = Results(limit=1 << 30)
    held = [_pool_tensor(pool) for _ in range(2)]
    assert pool.nbytes == 0  # no tensor kept: nothing would tell when one is dropped
    a = pool.empty(("numpy", "float64", (N,)), (N,), np.empty, N)  # numpy needs no torch
    assert pool.nbytes == N * 8
    del a


def test_mpi_plans_of_small_torch_calls_hold_only_while_their_tensors_are_unchanged():
    pytest.importorskip("mpi4py")
    from tests.support import open_comm

    from spmd.comms.state import plans
    from spmd.failfast.calls import Monitor

    comm = open_comm("mpi", Monitor())
    kept = comm._caches.plans
    x, out = torch.tensor([1.0, 2.0]), torch.empty(2)
    first = comm.all_gather(x, equal=True, out=out)
    assert len(kept) == 1 and torch.equal(out, x)
    x.fill_(5.0)  # data changed in place: the same plan moves the new values
    again = comm.all_gather(x, equal=True, out=out)
    assert len(kept) == 1 and again is not first and again[0] is first[0] and torch.equal(again[0], x)
    again[0].unsqueeze_(0)  # a view it handed out changed shape: planned anew
    fresh = comm.all_gather(x, equal=True, out=out)
    assert fresh[0] is not first[0] and fresh[0].shape == (2,)
    x.resize_(4)  # address or shape changed: planned anew, and checked (shapes now differ)
    with pytest.raises(spmd.CollectiveError):
        comm.all_gather(x, equal=True, out=out)
    square, into = torch.arange(4.0).reshape(2, 2), torch.empty(2, 2)
    comm.all_gather(square, equal=True, out=into)
    square.t_()  # the same address and shape, no longer contiguous: the general path copies it
    comm.all_gather(square, equal=True, out=into)
    assert torch.equal(into, torch.tensor([[0.0, 2.0], [1.0, 3.0]]))
    # A tensor that died and whose id came back is not mistaken for it.
    for value in (7.0, 8.0):
        y = torch.full((2,), value)
        comm.gather(y, 0, equal=True, out=out)
        assert torch.equal(out, y)
        del y
    big = torch.ones(plans.LIMIT // 4 + 1)
    before = len(kept)
    comm.scatter(big, 0, equal=True, out=torch.empty_like(big))
    assert len(kept) == before, "a tensor over plans.LIMIT bytes was planned"
    comm._caches.switch("plans", False)
    z = torch.ones(2)
    comm.scatter(z, 0, equal=True, out=torch.empty(2))
    assert len(kept) == 0
