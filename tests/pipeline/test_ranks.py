"""spmd.pipeline.ranks: every rank's run in its steps, at three ranks in one process (a world of threads)."""

from dataclasses import replace

import numpy as np
import pytest

from spmd.errors import PipelineError
from spmd.pipeline import checksum
from spmd.pipeline.plan import Options, Span
from spmd.pipeline.progress import Laps
from spmd.pipeline.ranks import check_statuses, raise_pending
from spmd.pipeline.roles import OtherRank, RootRank, one_rank
from spmd.pipeline.root import Root
from spmd.pipeline.rounds import Status
from spmd.pipeline.run import pipeline
from spmd.pipeline.sources import SyntheticTable

from tests.support import ThreadComm, open_comm, run_ranks

pytestmark = pytest.mark.timeout(60)


class PipelineThreadComm(ThreadComm):
    """A world of threads with the pipeline's array collectives (copies, as a transfer makes)."""

    def scatter(self, chunks=None, root=0):
        return self._exchange(chunks)[root][self.rank].copy()

    def gather(self, x, root=0, *, out=None):
        parts = self._exchange(x)
        if self.rank != root:
            return None
        if out is None:
            return [p.copy() for p in parts]
        views, at = [], 0
        for p in parts:
            out[at : at + len(p)] = p
            views.append(out[at : at + len(p)])
            at += len(p)
        return views


def at_three(fn):
    return run_ranks(3, lambda comm: fn(PipelineThreadComm(comm.world, comm.rank)))


def _triple(block):
    return block * np.float32(3)


@pytest.mark.unit
@pytest.mark.parametrize("read,write", [("parallel", "parallel"), ("root", "root")])
def test_three_ranks_share_the_rounds_and_put_the_rows_in_order(tmp_path, read, write):
    table = SyntheticTable(1000, 3, seed=2)
    out = tmp_path / "out.npy"
    results, errors, _ = at_three(lambda comm: pipeline(_triple, table if comm.rank == 0 else None, output=out,
                                                        chunk_rows=300, comm=comm, read=read, write=write))
    assert errors == [None] * 3, errors
    r = results[0]
    assert results[1:] == [None, None] and (r.read_mode, r.write_mode) == (read, write)
    assert np.array_equal(np.load(out), table.read(0, 1000) * 3) and r.checksum == checksum.get().of(np.load(out))
    assert r.rounds == 4 and r.rows_per_rank == [334, 333, 333]  # rounds of 300 (100 each) and 100 (34, 33, 33)


@pytest.mark.unit
def test_a_failure_on_one_rank_is_raised_alike_on_every_rank():
    def body(comm):
        def fn(block):
            if comm.rank == 2:
                raise KeyError("boom")
            return block

        try:
            pipeline(fn, SyntheticTable(90, 2) if comm.rank == 0 else None, chunk_rows=30, comm=comm)
        except PipelineError as exc:
            return str(exc)

    results, errors, _ = at_three(body)
    assert errors == [None] * 3 and len(set(results)) == 1, results
    assert results[0] == "pipeline: fn failed on rank 2 of 3, rows 0 to 30: KeyError: 'boom'"


def a_run(rows=10, chunk=4, start=0):
    comm, options, lap = open_comm("serial", None), Options(overlap=False), Laps()
    books = Root(comm, lambda b: b, options, lap)
    reply = books.open(SyntheticTable(rows, 2), None, chunk, None, "root", False, None)
    run = one_rank(comm, lambda b: b, 0, books, replace(reply[1], start=start), lap, options)
    run.agree()
    return run


@pytest.mark.unit
def test_the_first_round_and_reading_ahead_follow_the_plan_to_its_end():
    run = a_run()
    assert run.read_mode == "root" and run.crc.name == checksum.kind() and run.reader is not None  # rank 0 is root
    first = run.first_round()
    assert first == Span.at(0, [4])
    assert run.read_ahead(first) == Span.at(4, [4]) and run.read_ahead(Span.at(4, [4])) == Span.at(8, [2])
    assert run.read_ahead(Span.at(8, [2])) is None
    assert run.reader.asked == [(0, 4), (4, 8), (8, 10)]  # overlap=False: read when taken
    assert a_run(start=10).first_round() is None  # a journal says every row is done


@pytest.mark.unit
def test_statuses_say_the_first_failure_and_a_disagreement():
    with pytest.raises(PipelineError, match=r"fn failed on rank 1 of 3, rows 0 to 9: E \(and on 1 more ranks\)"):
        check_statuses([Status(), Status(error=("fn", "E")), Status(error=("read", "R"))], 0, 9, 3, 0)
    with pytest.raises(PipelineError, match="^pipeline: on rank 2 of 3: R$"):
        check_statuses([Status(), Status(), Status(error=("read", "R"))], 0, 9, 3, 0)
    with pytest.raises(PipelineError, match="^pipeline: on rank 0: kept$"):
        check_statuses([Status(pending="kept"), Status(error=("fn", "E"))], 0, 9, 2, 0)
    with pytest.raises(PipelineError, match="same dtype and row shape on every rank; got rank 0: float32"):
        check_statuses([Status(dtype="float32", row_shape=(2,)), Status(dtype="float64", row_shape=(2,))], 0, 9, 2, 0)
    check_statuses([Status(dtype="float32"), Status()], 0, 9, 2, 0)  # a rank without rows says no dtype
    raise_pending(None, 0)
