"""The pool of result buffers: what it hands back, what it keeps, and its limit."""

import numpy as np
import pytest
import torch

from spmd.comms.state.results import MIN_ITEMS, PER_SHAPE, Results, limit_from

pytestmark = pytest.mark.unit

N = MIN_ITEMS  # items: just large enough to be kept
KEY = ("numpy", "float64", (N,))


def numpy_result(pool, key=KEY, n=N):
    return pool.empty(key, (n,), np.empty, n)


def test_a_dropped_numpy_result_comes_back_and_a_held_one_or_its_view_never_does():
    pool = Results(limit=1 << 30)
    first = numpy_result(pool)
    second = numpy_result(pool)
    assert second is not first  # first is still held
    kept = id(first)
    del first
    third = numpy_result(pool)
    assert id(third) == kept  # the dropped buffer, back
    view = third[:3]
    del third
    assert id(numpy_result(pool)) != kept  # its view holds it
    del view
    assert id(numpy_result(pool)) == kept


def test_a_tensor_comes_back_only_when_no_tensor_shares_its_storage():
    pool = Results(limit=1 << 30)
    key = ("torch", torch.float32, (N,))
    t = pool.empty(key, (N,), torch.empty, N)
    kept = id(t)
    shared = t.detach()  # another tensor on the same storage, not a view of t
    as_numpy = t[:4].numpy()
    del t
    assert id(pool.empty(key, (N,), torch.empty, N)) != kept
    del shared
    assert id(pool.empty(key, (N,), torch.empty, N)) != kept  # the numpy array still holds a view
    del as_numpy
    assert id(pool.empty(key, (N,), torch.empty, N)) == kept


def test_small_results_are_made_fresh_and_never_kept():
    pool = Results(limit=1 << 30)
    made = []
    pool.empty(("small",), (N - 1,), lambda: made.append(1) or np.empty(N - 1))
    pool.empty(("small",), (N - 1,), lambda: made.append(1) or np.empty(N - 1))
    assert len(made) == 2 and pool.nbytes == 0


def test_at_most_per_shape_buffers_of_one_key_and_the_limit_in_all():
    pool = Results(limit=1 << 30)
    held = [numpy_result(pool) for _ in range(PER_SHAPE + 2)]  # all held: each one new
    assert len({id(a) for a in held}) == PER_SHAPE + 2
    assert pool.nbytes == PER_SHAPE * N * 8
    del held

    small = Results(limit=N * 8 + N * 8 // 2)  # room for one buffer
    a = numpy_result(small)
    b = small.empty(("other",), (N,), np.empty, N)  # no room while a is held
    assert small.nbytes == N * 8
    del a  # dropped: it makes room for the next key that needs it
    c = small.empty(("other",), (N,), np.empty, N)
    kept = id(c)
    del c, b
    assert small.nbytes == N * 8 and id(small.empty(("other",), (N,), np.empty, N)) == kept


def test_a_limit_of_zero_keeps_nothing_and_clear_lets_go():
    off = Results(limit=0)
    made = []
    for _ in range(2):
        off.empty(KEY, (N,), lambda: made.append(1) or np.empty(N))
    assert len(made) == 2 and off.nbytes == 0
    pool = Results(limit=1 << 30)
    numpy_result(pool)
    assert pool.nbytes == N * 8
    pool.clear()
    assert pool.nbytes == 0


def test_the_limit_comes_from_spmd_keep_results():
    assert limit_from({"SPMD_KEEP_RESULTS": "512M"}) == 512 << 20
    assert limit_from({"SPMD_KEEP_RESULTS": "0"}) == 0
    assert 0 < limit_from({}) <= 1 << 30
    assert limit_from({}, local_size=1 << 20) < limit_from({})  # the machine's share per rank
    with pytest.raises(ValueError, match=r"SPMD_KEEP_RESULTS='lots' is not a size.*512M.*or 0"):
        limit_from({"SPMD_KEEP_RESULTS": "lots"})


def test_a_result_changed_in_place_before_it_was_dropped_is_never_handed_out():
    pool = Results(limit=1 << 30)
    a = numpy_result(pool)
    kept = id(a)
    a.shape = (N // 2, 2)  # numpy's in-place reshape
    del a
    again = numpy_result(pool)
    assert id(again) != kept and again.shape == (N,)
    key = ("torch", torch.float32, (N,))
    for change in (lambda t: t.resize_(N // 2), lambda t: t.unsqueeze_(0), lambda t: t.requires_grad_(),
                   lambda t: t.set_(torch.empty(N).untyped_storage())):
        t = pool.empty(key, (N,), torch.empty, N)
        change(t)
        kept = id(t)
        del t
        again = pool.empty(key, (N,), torch.empty, N)
        assert id(again) != kept and again.shape == (N,) and not again.requires_grad
        del again
