"""spmd.train.overlap: buckets sent from gradient hooks, learning which parameters get no gradient."""

import copy

import pytest
import torch

from tests.support import ranks_ok, run_ranks
from tests.train.nets import Branchy, Stem, data, grads, loss_of
from spmd.train.data_parallel import DataParallel


@pytest.mark.unit
def test_overlap_learns_which_parameters_get_no_gradient_and_adds_late_ones():
    torch.manual_seed(0)
    base = Stem()
    x, y = data(8)

    def loss(model, lo, stem):
        return ((model(x[lo : lo + 4], stem) - y[lo : lo + 4]) ** 2).mean()

    # Whether rank 1 uses the stem, per step (rank 0 never does).  At step 2 the
    # stem has been learned to get nothing: its buckets leave after the trunk's,
    # and its gradients come after that, late.
    plan = [False, False, True, True]

    def rank(comm):
        model = copy.deepcopy(base)
        dp = DataParallel(model, comm, bucket_mb=1e-9, overlap=True)  # a bucket per parameter
        out = []
        for stem in plan:
            before = len(comm.world.calls[comm.rank])
            loss(model, comm.rank * 4, stem and comm.rank == 1).backward()
            during = len(comm.world.calls[comm.rank]) - before
            dp.synchronize()
            out.append((grads(model), during, len(comm.world.calls[comm.rank]) - before))
            model.zero_grad(set_to_none=True)
        return out, [[n for n, q in model.named_parameters() if q is b.params[0]][0] for b in dp.buckets]

    (out, _) = ranks_ok(run_ranks(2, rank))
    # After the first step the buckets follow backward's order; the stem, which got nothing, goes last.
    assert out[0][1][-2:] == ["stem.bias", "stem.weight"] and out[0][1] == out[1][1]
    for step, stem in enumerate(plan):
        ref = copy.deepcopy(base)
        ((loss(ref, 0, False) + loss(ref, 4, stem)) / 2).backward()
        for r in range(2):
            got, during, calls = out[r][0][step]
            for name, want in grads(ref).items():
                if want is None:
                    assert got[name] is None, (step, r, name)
                else:
                    torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-7)
            # Step 0: the stem's buckets wait for synchronize; later every bucket leaves in backward.
            assert during == (4 if step == 0 else 6), (step, r, during)
            # Six buckets and the used map; at step 2 both stem buckets once more, on both ranks.
            assert calls == 7 + (2 if step == 2 else 0), (step, r, calls)


@pytest.mark.unit
def test_a_second_backward_before_synchronize_is_an_error():
    base = Branchy()

    def rank(comm):
        model = copy.deepcopy(base)
        dp = DataParallel(model, comm, overlap=True)
        x, y = data()
        loss_of(model, x, y).backward()
        loss_of(model, x, y).backward()

    errors = run_ranks(2, rank)[1]
    for e in errors:
        assert isinstance(e, RuntimeError) and "no_sync" in str(e), e


@pytest.mark.unit
def test_every_rank_starts_from_the_roots_parameters_and_buckets_follow_its_backward_order():
    base = Branchy()
    x, y = data(8)
    moved = copy.deepcopy(base)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(1.0)
    ref = copy.deepcopy(moved)
    ((loss_of(ref, x[:4], y[:4], 0) + loss_of(ref, x[4:], y[4:], 1)) / 2).backward()

    def rank(comm):
        model = copy.deepcopy(moved if comm.rank == 1 else base)
        dp = DataParallel(model, comm, bucket_mb=1e-9, overlap=True, root=1)  # a bucket per parameter
        state = {k: v.clone() for k, v in model.state_dict().items()}
        lo = comm.rank * 4
        dp.backward(loss_of(model, x[lo : lo + 4], y[lo : lo + 4], comm.rank))
        names = {id(q): n for n, q in model.named_parameters()}
        return state, grads(model), [names[id(b.params[0])] for b in dp.buckets]

    (out, _) = ranks_ok(run_ranks(2, rank))
    for state, got, order in out:
        for name, t in state.items():
            assert torch.equal(t, moved.state_dict()[name]), name
        for name, want in grads(ref).items():
            if want is None:
                assert got[name] is None, name
            else:
                torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-7)
        # Rank 1 (the root) uses head 1: its backward produced head 1's gradients first.
        assert order[0].startswith("heads.1."), order
    assert out[0][2] == out[1][2]
