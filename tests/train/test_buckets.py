"""spmd.train.buckets: how gradients are grouped into buckets, packed and unpacked."""

import pytest
import torch
from torch import nn

from tests.train.nets import Branchy
from spmd.comms.backends.serial import SerialBackend
from spmd.comms.comm import Comm
from spmd.train.buckets import Bucket, auto_bucket_mb, plan_buckets
from spmd.train.data_parallel import DataParallel


@pytest.mark.unit
def test_plan_buckets_fills_up_to_the_limit_and_never_splits():
    t = [torch.zeros(100) for _ in range(5)]  # 400 bytes each
    assert plan_buckets(t, 800) == [[0, 1], [2, 3], [4]]
    assert plan_buckets(t, 799) == [[0], [1], [2], [3], [4]]
    assert plan_buckets(t, 10_000) == [[0, 1, 2, 3, 4]]
    big = [torch.zeros(10), torch.zeros(1000), torch.zeros(10)]
    assert plan_buckets(big, 100) == [[0], [1], [2]]  # the big one alone, whole


@pytest.mark.unit
def test_plan_buckets_keeps_dtypes_apart():
    t = [torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(10), torch.zeros(10, dtype=torch.float64)]
    assert plan_buckets(t, 1000) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(t, 0)


@pytest.mark.unit
def test_default_bucket_size_is_25_mb_and_with_overlap_a_quarter_of_the_model_unless_crowded():
    mb = [torch.zeros(1 << 18)]  # 1 MiB of float32
    assert auto_bucket_mb(mb * 12, overlap=False) == 25.0
    assert auto_bucket_mb(mb * 12, overlap=True) == 3.0
    assert auto_bucket_mb(mb * 2, overlap=True) == 1.0  # at least 1
    assert auto_bucket_mb(mb * 400, overlap=True) == 25.0  # at most 25
    assert auto_bucket_mb(mb * 12, overlap=True, crowded=True) == 25.0  # more ranks than CPUs
    assert DataParallel(Branchy(), Comm(SerialBackend())).bucket_mb == 25.0
    assert DataParallel(Branchy(), Comm(SerialBackend()), bucket_mb=2).bucket_mb == 2


@pytest.mark.unit
def test_buckets_hold_every_trainable_parameter_once_in_reverse_order():
    model = Branchy()
    dp = DataParallel(model, Comm(SerialBackend()), bucket_mb=100 / 2**20)  # ~100 bytes
    trainable = [p for p in model.parameters() if p.requires_grad]
    seen = [p for b in dp.buckets for p in b.params]
    assert [id(p) for p in seen] == [id(p) for p in reversed(trainable)]
    assert all(not p.requires_grad for p in model.frozen.parameters())
    for b in dp.buckets:
        assert b.nbytes <= 100 or len(b.params) == 1
    assert len(dp.buckets) > 3


@pytest.mark.unit
def test_a_bucket_packs_zeros_for_missing_gradients_and_unpacks_only_the_chosen():
    a, b = nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(3))
    a.grad = torch.full((2, 2), 4.0)
    bucket = Bucket(0, [a, b], None)
    sent = bucket.pack(2)
    assert sent is bucket.flat and sent.tolist() == [4.0] * 4 + [0.0] * 3
    bucket.unpack(bucket.source(2), lambda p: p is a)  # the sums, divided on the way in
    assert torch.equal(a.grad, torch.full((2, 2), 2.0)) and b.grad is None
    half = Bucket(0, [a], "bf16")
    wire = half.pack(2)  # divided before it is cast down
    assert wire.dtype == torch.bfloat16 and wire.tolist() == [1.0] * 4
    a.grad = None
    half.unpack(half.source(2), lambda p: True)  # the wire holds averages: widened, not divided
    assert a.grad.dtype == torch.float32 and torch.equal(a.grad, torch.ones(2, 2))

