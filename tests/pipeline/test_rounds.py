"""spmd.pipeline.rounds: a rank's Status, fn's application, the reader and writer threads."""

import pickle

import numpy as np
import pytest

from spmd.pipeline import checksum
from spmd.pipeline.rounds import Reader, Status, Writer, apply, as_numpy

pytestmark = pytest.mark.timeout(60)


@pytest.mark.unit
def test_a_status_is_built_by_name_and_travels_as_it_is():
    s = Status(rows=3, error=("fn", "boom"), preempted=True)
    assert (s.rows, s.error, s.pending, s.dtype, s.busy, s.preempted) == (3, ("fn", "boom"), None, "", 0.0, True)
    assert pickle.loads(pickle.dumps(s)) == s


@pytest.mark.unit
def test_apply_checks_fns_rows_and_checksums_both_ways():
    crc = checksum.get("crc32")
    block = np.arange(12.0).reshape(4, 3)
    out, error, in_crc, out_crc, seconds = apply(lambda b: b[:, :1] * 2, block, crc)
    assert error is None and out.shape == (4, 1) and out.flags.c_contiguous
    assert (in_crc, out_crc) == (crc.of(block), crc.of(block[:, :1] * 2)) and seconds >= 0
    out, error, in_crc, _, _ = apply(lambda b: b[:2], block, crc)
    assert out is None and "one row per input row" in error and in_crc == crc.of(block)
    assert "ZeroDivisionError" in apply(lambda b: 1 / 0, block, crc)[1]
    with pytest.raises(TypeError, match="numpy array or a torch tensor, got list"):
        as_numpy([1, 2])


@pytest.mark.unit
@pytest.mark.parametrize("overlap", [True, False])
def test_the_reader_returns_ranges_in_request_order_and_keeps_errors(overlap):
    def read(a, b):
        if a == 13:
            raise OSError("bad sector")
        return np.arange(a, b)

    reader = Reader(read, overlap)
    try:
        for span in ((0, 5), (5, 9), (13, 20)):
            reader.request(*span)
        assert reader.take().value.tolist() == [0, 1, 2, 3, 4]
        assert reader.take().value.tolist() == [5, 6, 7, 8]
        done = reader.take()
        assert done.value is None and done.error == "reading rows 13 to 20: OSError: bad sector"
    finally:
        reader.close()


@pytest.mark.unit
@pytest.mark.parametrize("overlap", [True, False])
def test_the_writer_writes_in_order_keeps_the_first_error_and_drops_the_rest(overlap):
    written = []

    def write(item):
        if item == 2:
            raise ValueError("disk full")
        written.append(item)

    writer = Writer(write, overlap)
    for item in range(5):
        writer.put(item)
    writer.finish()
    writer.close()
    assert written == [0, 1] and writer.error == "ValueError: disk full"
