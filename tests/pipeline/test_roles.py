"""spmd.pipeline.roles: root's side and another rank's, picked once, at three ranks in one process."""

import numpy as np
import pytest

from spmd.pipeline import rounds, run as run_module
from spmd.pipeline.roles import OtherRank, RootRank, one_rank
from spmd.pipeline.run import pipeline
from spmd.pipeline.sources import SyntheticTable

from tests.pipeline.test_ranks import at_three

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.mark.parametrize("read", ["root", "parallel"])
def test_root_reads_for_all_or_its_own_rows_and_the_others_only_their_own(monkeypatch, tmp_path, read):
    made, asked = {}, []
    real_request = rounds.Reader.request

    def spy(comm, *args):
        made[comm.rank] = one_rank(comm, *args)
        return made[comm.rank]

    def request(reader, start, stop):
        asked.append((reader, start, stop))
        return real_request(reader, start, stop)

    monkeypatch.setattr(run_module, "one_rank", spy)
    monkeypatch.setattr(rounds.Reader, "request", request)
    table, out = SyntheticTable(90, 2, seed=1), tmp_path / "out.npy"
    results, errors, _ = at_three(lambda comm: pipeline(lambda b: b + 1, table if comm.rank == 0 else None,
                                                        output=out, chunk_rows=30, comm=comm, read=read))
    assert errors == [None] * 3, errors
    assert results[0].read_mode == read and np.array_equal(np.load(out), table.read(0, 90) + 1)
    assert type(made[0]) is RootRank and [type(made[r]) for r in (1, 2)] == [OtherRank, OtherRank]
    spans = {r: [(a, b) for reader, a, b in asked if reader is made[r].reader] for r in range(3)}
    if read == "root":
        assert spans[0] == [(0, 30), (30, 60), (60, 90)]  # every round whole, for every rank
        assert made[1].reader is None and made[2].reader is None
    else:
        assert spans[0] == [(0, 10), (30, 40), (60, 70)]  # its own share of each round
        assert spans[2] == [(20, 30), (50, 60), (80, 90)]
