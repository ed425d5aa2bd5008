"""spmd.pipeline.agree: every rank's Report and the modes decided alike from them."""

import pickle

import pytest

from spmd.errors import PipelineError
from spmd.pipeline import agree, checksum
from spmd.pipeline.plan import Options, Plan
from spmd.pipeline.sources import SyntheticTable


def a_plan(**changes):
    fields = dict(rows=100, chunk=10, shape=(100, 4), dtype="float32", in_row_bytes=16, positional=False,
                  resume=False, checksum="crc32c", forced=False, why_root="the source is read by root alone")
    return Plan(**dict(fields, **changes))


def reports(*reads, crc32c=(True, True, True), hosts=("a", "a", "b"), free=(None, None, None)):
    return [agree.Report(h, c, None, r, f) for h, c, r, f in zip(hosts, crc32c, reads, free)]


@pytest.mark.unit
def test_every_rank_reads_its_own_rows_only_where_every_rank_opened_the_source():
    shared = a_plan(shared=b"x")
    assert agree.read_mode(shared, "auto", reports(None, None, None)) == ("parallel", None)
    assert agree.read_mode(shared, "auto", reports(None, None, "b: OSError: gone")) == (
        "root", "root reads and scatters: rank 2 cannot open the source (b: OSError: gone)")
    assert agree.read_mode(a_plan(), "root", reports(None, None, None)) == ("root", None)
    assert agree.read_mode(a_plan(), "auto", reports(None)) == ("root", None)  # a world of one: no note
    with pytest.raises(PipelineError, match="read='parallel' is impossible: the source is read by root alone"):
        agree.read_mode(a_plan(), "parallel", reports(None, None, None))


@pytest.mark.unit
def test_the_checksum_falls_back_to_crc32_where_a_rank_lacks_crc32c_unless_it_was_named():
    lacking = reports(None, None, None, crc32c=(True, False, True))
    assert agree.checksum_of(a_plan(), lacking).name == "crc32"
    with pytest.raises(PipelineError, match="but ranks 1 lack the crc32c package"):
        agree.checksum_of(a_plan(forced=True), lacking)
    assert agree.checksum_of(a_plan(checksum="crc32"), reports(None, None, None)).name == "crc32"
    if checksum.has_crc32c():
        assert agree.checksum_of(a_plan(), reports(None, None, None)).name == "crc32c"


@pytest.mark.unit
def test_free_memory_is_shared_among_the_ranks_of_a_host_and_budgets_win():
    assert agree.budgets(reports(None, None, None)) is None
    assert agree.budgets(reports(None, None, None, free=(1000, 1000, 1000))) == [500, 500, 1000]
    mixed = [agree.Report("a", True, budget=64), agree.Report("a", True, free=900)]
    assert agree.budgets(mixed) == [64, 450]
    with pytest.raises(PipelineError, match="pipeline: on rank 1: ValueError: no"):
        agree.raise_errors([agree.Report("a", True), agree.Report("a", True, error="ValueError: no")])


@pytest.mark.unit
def test_a_rank_reports_a_shared_source_that_differs_from_roots():
    plan = a_plan(shared=pickle.dumps(SyntheticTable(100, 5, 0)))
    mine, src = agree.report(plan, Options(), rank=1, root=0)
    assert src is None and "it holds float32 rows of shape (100, 5) here" in mine.read
    mine, src = agree.report(a_plan(shared=pickle.dumps(SyntheticTable(100, 4, 0))), Options(memory="1M"), 1, 0)
    assert mine.read is None and src.shape == (100, 4) and mine.budget == 1 << 20
    mine, src = agree.report(plan, Options(), rank=0, root=0)  # root has the source as given
    assert src is None and mine.read is None
