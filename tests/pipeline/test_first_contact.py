"""Input and output mistakes a newcomer makes, found before any compute, each said with its fix."""

import numpy as np
import pytest

from spmd.errors import PipelineValueError, SourceError
from spmd.pipeline.sinks import check_output
from spmd.pipeline.sources import CsvSource, NpySource

pytestmark = pytest.mark.unit


def test_a_truncated_npy_says_both_sizes_and_asks_whether_it_was_copied(tmp_path):
    whole = tmp_path / "in.npy"
    np.save(whole, np.zeros((1000, 16), np.float32))
    short = tmp_path / "short.npy"
    short.write_bytes(whole.read_bytes()[:10_000])
    with pytest.raises(SourceError) as got:
        NpySource(short)
    text = str(got.value)
    assert "shorter than its header says: 10,000 bytes" in text and "needs 64,128" in text, text
    assert "1000x16 float32" in text and "copied completely?" in text and "memory-map" not in text
    assert NpySource(whole).shape == (1000, 16)


@pytest.mark.parametrize("content, words", [
    (b"", "the file is empty (0 bytes)"),
    (b"hello, world\n", "not a .npy file"),
    (b"\x93NUMPY\x01\x00\x10\x00{'descr': '<f8'", "its .npy header is damaged"),
])
def test_a_file_that_is_not_a_whole_npy_is_named_as_such(tmp_path, content, words):
    path = tmp_path / "in.npy"
    path.write_bytes(content)
    with pytest.raises(SourceError, match=None) as got:
        NpySource(path)
    assert str(got.value).startswith(f"{path}: ") and words in str(got.value), str(got.value)


def test_an_array_of_objects_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "obj.npy"
    np.save(path, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(SourceError, match="save plain numeric arrays"):
        NpySource(path)


def test_a_ragged_csv_row_is_named_by_its_line_when_the_file_is_opened(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("a,b,c\n1,2,3\n\n4,5,6\n7,8\n9,10,11\n")
    with pytest.raises(SourceError) as got:
        CsvSource(path)
    assert str(got.value) == (f"{path}: line 5 has 2 comma-separated values but line 1 has 3: "
                              "every row needs the same number of columns")
    path.write_text("1,2\n3,4\n")
    assert CsvSource(path).shape == (2, 2)


def test_an_output_path_is_checked_before_anything_is_read(tmp_path):
    with pytest.raises(PipelineValueError) as got:
        check_output(tmp_path / "nowhere" / "o.npy")
    where = tmp_path / "nowhere"
    assert str(got.value) == (f"output {where / 'o.npy'}: the directory {where} does not exist; create it "
                              f"(mkdir -p {where}) or choose another output path")
    with pytest.raises(PipelineValueError, match="is a directory"):
        check_output(tmp_path)
    check_output(tmp_path / "o.npy")  # fine: nothing is made yet
    assert not (tmp_path / "o.npy").exists()


def test_an_output_directory_this_user_cannot_write_is_named(tmp_path, monkeypatch):
    import os

    monkeypatch.setattr(os, "access", lambda path, mode: False)  # root may write anywhere: ask as another
    with pytest.raises(PipelineValueError, match=f"the directory {tmp_path} is not writable by this user"):
        check_output(tmp_path / "o.npy")
