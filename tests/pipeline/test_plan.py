"""spmd.pipeline.plan: the Plan root broadcasts, the Options, a round's Span."""

import dataclasses
import pickle

import numpy as np
import pytest

from spmd.pipeline.plan import Options, Plan, Span


def a_plan(**changes):
    fields = dict(rows=10, chunk=4, shape=(10, 3), dtype="float32", in_row_bytes=12, positional=True,
                  resume=False, checksum="crc32", forced=False, why_root="the source is read by root alone")
    return Plan(**dict(fields, **changes))


@pytest.mark.unit
def test_a_plan_pickles_to_an_equal_value_and_cannot_be_changed_in_place():
    plan = a_plan(shared=pickle.dumps([1, 2]), layout=("float64", (8,)))
    assert pickle.loads(pickle.dumps(plan)) == plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.rows = 11
    assert dataclasses.replace(plan, start=4).start == 4 and plan.start == 0
    assert plan.row_shape == (3,)
    empty = plan.no_rows()
    assert empty.shape == (0, 3) and empty.dtype == np.float32


@pytest.mark.unit
def test_options_default_to_the_pipeline_defaults():
    assert Options() == Options(read="auto", write="auto", balance="even", memory=None, verify=False, overlap=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Options().verify = True


@pytest.mark.unit
def test_a_span_knows_every_ranks_rows():
    span = Span.at(100, [4, 3, 0, 3])
    assert span.shares == (4, 3, 0, 3) and (span.start, span.stop, span.rows) == (100, 110, 10)
    assert [span.offset(r) for r in range(4)] == [0, 4, 7, 7]
    assert [span.rows_of(r) for r in range(4)] == [(100, 104), (104, 107), (107, 107), (107, 110)]
    assert Span.at(5, [0, 0]).rows == 0 and Span.at(5, [0, 0]).stop == 5
