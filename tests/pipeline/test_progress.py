"""spmd.pipeline.progress: the phase clock, the bar, the per-rank sums and the Result's summary."""

import io

import pytest

from spmd.pipeline.progress import PHASES, Bar, Laps, PerRank, Result
from spmd.pipeline.rounds import Status


@pytest.mark.unit
def test_laps_add_the_time_since_the_last_lap_to_a_phase():
    lap = Laps()
    lap("load")
    lap("write")
    times = lap.timings()
    assert set(times) == set(PHASES) - {"verify"} and times["load"] >= 0 and lap.total() >= times["write"]
    lap.times["verify"] = 0.25  # verify ran
    assert lap.timings()["verify"] == 0.25


@pytest.mark.unit
def test_the_bar_draws_the_last_state_and_ends_its_line():
    out = io.StringIO()
    bar = Bar(out)
    bar(5, 10)
    bar(6, 10)  # within 0.2 s: not drawn
    bar(10, 10)
    text = out.getvalue()
    assert "5/10 rows" in text and "6/10" not in text and "10/10 rows" in text
    assert text.endswith(" s\n") and "100%" in text


@pytest.mark.unit
def test_per_rank_sums_add_every_rounds_statuses():
    sums = PerRank(2)
    sums.add([Status(rows=3, seconds=0.5, busy=1.0), Status(rows=2, seconds=0.25, busy=2.0)])
    sums.add([Status(rows=1, seconds=0.5, busy=1.0), Status()])
    assert (sums.rows, sums.seconds, sums.busy) == ([4, 2], [1.0, 0.25], [2.0, 2.0])


@pytest.mark.unit
def test_the_summary_says_what_a_resumed_verified_run_did():
    r = Result(rows=10, rows_out=10, ranks=2, backend="gloo", rounds=3, chunk_rows=4, row_shape=(2, 3),
               dtype="float32", timings={"load": 0.5, "process": 1.0}, total_s=2.0, checksum=0xAB,
               input_checksum=0xCD, rows_per_rank=[3, 3], process_per_rank=[0.5, 0.25], verified=False,
               mismatched_rows=2, first_mismatch=7, resumed_rows=4, resumed_rounds=1, notes=("root writes: x",))
    assert r.rows_processed == 6 and r.rows_per_second == 3.0
    text = r.summary()
    for words in ("10 rows in, 10 out (2x3 float32 each); 2 ranks, backend gloo; 3 rounds of up to 4 rows",
                  "seconds: load 0.500, process 1.000; total 2.000", "checksum crc32 000000ab (input 000000cd)",
                  "resumed at row 4 (1 round done before); this run read and computed 6 rows",
                  "note: root writes: x", "verify: FAILED, 2 rows differ (first: row 7)"):
        assert words in text, (words, text)
