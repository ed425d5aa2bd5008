"""How the pipeline reads and writes Parquet: no pandas, columns from their buffers, encodings by type, row groups."""

import subprocess
import sys

import numpy as np
import pytest

from spmd.pipeline.run import Output, pipeline

from tests.support import REPO, clean_env

pa = pytest.importorskip("pyarrow", reason="the formats extra: pip install 'spmd[formats]'")
pq = pytest.importorskip("pyarrow.parquet")

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def test_a_column_is_copied_from_its_buffers_whatever_its_chunks_offsets_and_type():
    from spmd.pipeline.formats.parquet import column_into

    flags = [True, False, True, True, False, False, True, False, True, True, False]
    columns = [
        pa.chunked_array([pa.array(flags).slice(3), pa.array([False, True]), pa.array(flags[:5]).slice(1, 3)]),
        pa.chunked_array([pa.array(np.arange(10, dtype=np.int16)).slice(3, 5), pa.array(np.arange(4, dtype=np.int16))]),
        pa.chunked_array([pa.array(np.linspace(0, 1, 9, dtype=np.float32)).slice(2)]),
        pa.chunked_array([pa.array(np.arange(2**62, 2**62 + 5, dtype=np.uint64))]),
    ]
    for column in columns:
        out = np.full(len(column), 7, column.to_numpy().dtype)
        column_into(out, column)
        assert out.tolist() == column.to_pylist(), column.type
    wide = np.zeros((4, 3), np.float64)  # into a strided column of a 2-D array
    column_into(wide[:, 1], pa.chunked_array([pa.array([1.5, 2.5]), pa.array([3.5, 4.5])]))
    assert wide.tolist() == [[0, 1.5, 0], [0, 2.5, 0], [0, 3.5, 0], [0, 4.5, 0]]


def test_a_parquet_run_in_and_out_does_not_import_pandas(tmp_path):
    # pyarrow's to_numpy and pa.array import pandas on their first call (0.25 s here): a run needs neither
    code = f"""
import sys
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
from spmd.pipeline.run import pipeline
rows = np.arange(3000 * 3, dtype=np.float32).reshape(3000, 3)
pq.write_table(pa.Table.from_arrays([pa.Array.from_buffers(pa.float32(), 3000, [None, pa.py_buffer(
    np.ascontiguousarray(rows[:, j]))]) for j in range(3)], names=["a", "b", "c"]), "{tmp_path}/in.parquet",
    row_group_size=1000)
res = pipeline(lambda b: b * 2, "{tmp_path}/in.parquet", output="{tmp_path}/out.parquet", chunk_rows=700)
back = pipeline(lambda b: b, "{tmp_path}/out.parquet").output
print("pandas" in sys.modules, np.array_equal(back, rows * 2), res.rows)
"""
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), cwd=REPO, capture_output=True, text=True,
                         timeout=90)
    assert out.stdout.split() == ["False", "True", "3000"], out.stdout + out.stderr


def _rows(path):
    """Return a Parquet file's rows as one 2-D array, without pandas (pyarrow's to_pandas needs it)."""
    return np.column_stack([column.to_numpy() for column in pq.read_table(path).columns])


def _encodings(path):
    meta = pq.ParquetFile(path).metadata
    return {meta.schema.column(j).name: set(meta.row_group(0).column(j).encodings) for j in range(meta.num_columns)}


def test_float_columns_are_written_plain_and_integer_and_boolean_columns_keep_a_dictionary(tmp_path):
    table = np.random.default_rng(0).random((3000, 4), np.float32)
    floats = pipeline(lambda b: b * 2, table, output=str(tmp_path / "f.parquet"))
    for name, found in _encodings(floats.output).items():
        assert not any("DICTIONARY" in e for e in found), (name, found)  # distinct floats: a dictionary is waste
    ints = pipeline(lambda b: (b * 4).astype(np.int64), table, output=str(tmp_path / "i.parquet"))
    for name, found in _encodings(ints.output).items():
        assert any("DICTIONARY" in e for e in found), (name, found)  # four values a column: a dictionary pays
    flags = pipeline(lambda b: b > 0.5, table, output=str(tmp_path / "b.parquet"))
    assert np.array_equal(_rows(flags.output), table > 0.5)
    assert np.array_equal(_rows(ints.output), (table * 4).astype(np.int64))


def test_the_default_row_group_holds_about_8_mib_of_rows_whatever_the_rounds(tmp_path):
    from spmd.pipeline.formats.parquet_output import ROW_GROUP_BYTES

    table = np.random.default_rng(1).random((5000, 4), np.float32)
    wide = lambda b: np.repeat(b.astype(np.float64), 128, axis=1)  # noqa: E731  512 float64: 4 KiB a row
    per = ROW_GROUP_BYTES // (512 * 8)
    assert per == 2048
    for chunk in (700, 3000):
        res = pipeline(wide, table, output=Output(tmp_path / f"w{chunk}.parquet"), chunk_rows=chunk)
        meta = pq.ParquetFile(res.output).metadata
        assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [2048, 2048, 904]
    assert (tmp_path / "w700.parquet").read_bytes() == (tmp_path / "w3000.parquet").read_bytes()
