"""spmd.pipeline.root: what Root decides, and its books as Ranks asks for them."""

import numpy as np
import pytest

from spmd.pipeline import checksum
from spmd.pipeline.plan import Options, Plan, Span
from spmd.pipeline.progress import Laps
from spmd.pipeline.root import Root, differing_rows, task_name
from spmd.pipeline.rounds import Status
from spmd.pipeline.sources import SyntheticTable

from tests.support import open_comm

pytestmark = pytest.mark.timeout(60)
CRC = checksum.get("crc32")


def opened(output=None, verify=False, read="auto", **options):
    comm = open_comm("serial", None)
    books = Root(comm, lambda b: b * 2, Options(verify=verify, **options), Laps())
    reply = books.open(SyntheticTable(8, 2, seed=1), output, 4, None, read, False, None)
    assert reply[0] == "ok", reply
    return books, reply[1]


@pytest.mark.unit
def test_open_decides_the_plan_every_rank_gets():
    books, plan = opened()
    assert isinstance(plan, Plan) and books.plan == plan
    assert (plan.rows, plan.chunk, plan.shape, plan.dtype, plan.in_row_bytes) == (8, 4, (8, 2), "float32", 8)
    assert plan.shared is not None and not plan.positional and plan.start == 0 and plan.layout is None
    _, by_root = opened(read="root")
    assert by_root.shared is None and by_root.why_root == "read='root'"
    comm = open_comm("serial", None)
    bad = Root(comm, len, Options(), Laps()).open(SyntheticTable(8, 2), None, -1, None, "auto", False, None)
    assert bad == ("error", "chunk_rows must be at least 1, got -1", "PipelineValueError")


@pytest.mark.unit
def test_root_keeps_the_first_failure_and_the_writers():
    books, _ = opened()
    assert books.news() is None
    books.fail("reading rows 0 to 4: OSError: x")
    books.fail("a later one")
    assert books.pending == "reading rows 0 to 4: OSError: x"
    fresh, _ = opened()
    fresh.finish_round(Span.at(0, [0]), [Status(row_shape=(2,), dtype="float32")], None, CRC, False)  # starts the writer thread
    assert fresh.pending is None
    fresh.writer.error = "OSError: disk full"
    assert fresh.news() == "writing the output: OSError: disk full"
    fresh.close()


@pytest.mark.unit
def test_a_round_root_scattered_is_checked_joined_and_handed_to_the_output():
    books, _ = opened(verify=True)
    block = SyntheticTable(8, 2, seed=1).read(0, 4)
    parts = books.share_out(block, (3, 1), CRC)
    assert [p.shape[0] for p in parts] == [3, 1] and books.sent == [CRC.of(parts[0]), CRC.of(parts[1])]
    assert np.array_equal(books.kept, block) and books.kept is not block
    outs = [p * 2 for p in parts]
    statuses = [Status(rows=3, in_crc=books.sent[0], row_shape=(2,), dtype="float32", out_crc=CRC.of(outs[0])),
                Status(rows=1, in_crc=books.sent[1], row_shape=(2,), dtype="float32", out_crc=CRC.of(outs[1]))]
    books.finish_round(Span.at(0, (3, 1)), statuses, outs, CRC, True)
    books.drain()
    assert books.pending is None and books.rows_out == 4 and books.mismatched == 0
    assert books.in_crc == CRC.of(block) and books.out_crc == CRC.of(block * 2)
    wrong = [statuses[0], statuses[1]._replace(in_crc=1)]
    books.finish_round(Span.at(4, (3, 1)), wrong, outs, CRC, True)
    assert books.pending.startswith("after rows 4 to 8: PipelineError: rank 1 received 1 rows with crc32 00000001")
    assert books.finish_output(np.empty((0, 2), np.float32)) is None  # a failed run: no output
    books.close()


@pytest.mark.unit
def test_the_end_finds_rows_that_never_came_back():
    books, _ = opened()
    assert books.finish_output(np.empty((0, 2), np.float32)) is None  # no output from a failed run
    assert books.pending == "8 rows were read but 0 came back"


@pytest.mark.unit
def test_task_names_and_differing_rows():
    def fn(block):
        return block

    assert task_name(fn, "given") == "given" and task_name(fn, None).endswith("fn")
    fn.spmd_task = "copy seed 0 features 2"
    assert task_name(fn, None) == "copy seed 0 features 2"
    a = np.arange(12.0).reshape(4, 3)
    b = a.copy()
    b[2, 1] = -1
    assert differing_rows(a, b).tolist() == [2] and differing_rows(a, a).size == 0
    assert differing_rows(a, a[:3]).tolist() == [0, 1, 2, 3]  # shapes differ: every row
