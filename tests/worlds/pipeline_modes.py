"""Every read, write, balance and overlap mode of the pipeline gives the same bytes, in one world.

Run under a launcher at 3 ranks (tests/pipeline/test_run.py): python pipeline_modes.py WORKDIR.
Every rank prints CASE lines; rank 0 prints "MODES OK" at the end. Every
check that fails raises, which the launcher turns into a failed job.
"""

import os
import sys
import time
from pathlib import Path

import numpy as np

from spmd import comm
from spmd.pipeline import checksum
from spmd.pipeline import sinks
from spmd.pipeline import tasks
from spmd.errors import PipelineError, PipelineJournalError
from spmd.pipeline.run import SyntheticTable, pipeline

work = Path(sys.argv[1])
ROWS, CHUNK = 5000, 700
table = SyntheticTable(ROWS, 6, seed=3)
npy = work / "table.npy"
csv = work / "table.csv"
if comm.rank == 0:
    data = table.read(0, ROWS)
    np.save(npy, data)
    np.savetxt(csv, data.astype(np.float64), delimiter=",", fmt="%.17g")
comm.barrier()
fn = tasks.build("standardize", npy, seed=1)  # float64 rows of 8, the same on every rank
reference = fn(np.load(npy)) if comm.rank == 0 else None
csv_reference = fn(np.loadtxt(csv, delimiter=",", ndmin=2)) if comm.rank == 0 else None
crc = checksum.get()


def say(*words):
    print(f"CASE rank {comm.rank}:", *words, flush=True)


def same_everywhere(text):
    """Every rank got the same text (an error message raised alike)."""
    texts = comm.all_gather_object(text)
    assert len(set(texts)) == 1, texts
    return texts[0]


def raised(call, kind=PipelineError):
    try:
        call()
    except kind as exc:
        return same_everywhere(str(exc))
    raise AssertionError(f"{call} raised nothing")


# 1. every mode, same bytes; the Result says which mode ran
checksums = set()
for source, read, write, balance, overlap in [
    (npy, "auto", "auto", "even", True),
    (npy, "parallel", "parallel", "speed", True),
    (npy, "root", "root", "even", False),
    (npy, "auto", "root", "memory", True),
    (table if comm.rank == 0 else None, "auto", "parallel", "even", False),
    (work, "parallel", "auto", "speed", False),  # a folder of shards: table.npy alone
]:
    out = work / f"out-{read}-{write}-{balance}-{overlap}.npy"
    if source == work:
        shards = work / "shards"
        if comm.rank == 0:
            shards.mkdir(exist_ok=True)
            np.save(shards / "part1.npy", np.load(npy)[:1234])
            np.save(shards / "part2.npy", np.load(npy)[1234:])
        comm.barrier()
        source = shards
    r = pipeline(fn, source, output=out, chunk_rows=CHUNK, read=read, write=write, balance=balance,
                 overlap=overlap)
    if comm.rank == 0:
        assert np.array_equal(np.load(out), reference), (read, write, balance, overlap)
        assert r.read_mode == ("root" if read == "root" else "parallel"), (read, r.read_mode)
        assert r.write_mode == ("root" if write == "root" else "parallel"), (write, r.write_mode)
        assert r.checksum == crc.of(reference) and r.input_checksum == crc.of(np.load(npy)), r
        assert r.rows_processed == ROWS and sum(r.rows_per_rank) == ROWS and r.checksum_kind == crc.name
        assert not list(work.glob(".out-*spmd-tmp*")), list(work.glob(".*"))
        checksums.add(r.checksum)
        say("mode", read, write, balance, overlap, r.read_mode, r.write_mode, r.rows_per_rank)
assert comm.rank != 0 or len(checksums) == 1

# a .csv is read by root alone: auto says so; parallel is refused on every rank
r = pipeline(fn, csv, chunk_rows=CHUNK)
if comm.rank == 0:
    assert r.read_mode == "root" and "root reads and scatters" in r.notes[0], r.notes
    assert np.array_equal(r.output, csv_reference)
say("csv", raised(lambda: pipeline(fn, csv, read="parallel")))

# 2. a source every rank should read, but rank 2 cannot open: auto falls back, parallel is refused
class Fussy(SyntheticTable):
    def __reduce__(self):
        return (_open_fussy, (self.rows, self.features, self.seed))


def _open_fussy(*args):
    if comm.rank == 2:
        raise OSError("no such device here")
    return Fussy(*args)


fussy = Fussy(ROWS, 6, seed=3) if comm.rank == 0 else None
r = pipeline(lambda b: b * 2, fussy, chunk_rows=CHUNK)
if comm.rank == 0:
    assert r.read_mode == "root" and "rank 2 cannot open the source" in r.notes[0], r.notes
    assert np.array_equal(r.output, table.read(0, ROWS) * 2)
message = raised(lambda: pipeline(lambda b: b * 2, fussy, read="parallel"))
assert "rank 2 cannot open the source" in message and "no such device here" in message, message

# a rank that does not see root's output file (no shared file system): auto falls back to root writes
real_read_bytes = sinks.RowWriter.read_bytes
if comm.rank == 1:
    sinks.RowWriter.read_bytes = lambda self, offset, count: b"\0" * count
r = pipeline(fn, npy, output=work / "fallback.npy", chunk_rows=CHUNK)
if comm.rank == 0:
    assert r.write_mode == "root" and "rank 1 cannot open the output" in r.notes[0], r.notes
    assert np.array_equal(np.load(work / "fallback.npy"), reference)
message = raised(lambda: pipeline(fn, npy, output=work / "refused.npy", write="parallel"))
assert "write='parallel' is impossible: rank 1" in message and not (work / "refused.npy").exists(), message
sinks.RowWriter.read_bytes = real_read_bytes

# 3. memory: a rank with a small budget gets few rows, and never a block larger than its budget
biggest = [0]


def measured(block):
    biggest[0] = max(biggest[0], block.nbytes)
    return fn(block)


budget = "1M,1M,10K"
r = pipeline(measured, npy, output=work / "memory.npy", chunk_rows=CHUNK, balance="memory", memory=budget)
peak = comm.all_gather_object(biggest[0])
if comm.rank == 0:
    assert np.array_equal(np.load(work / "memory.npy"), reference)
    per_row = 2 * (6 * 4 + 8 * 8)  # two rounds in flight of a float32 row of 6 in, float64 row of 8 out
    assert peak[2] * 2 <= 10 * 1024 and r.rows_per_rank[2] < r.rows_per_rank[0] / 2, (peak, r.rows_per_rank)
    assert r.rows_per_rank[2] <= -(-ROWS // CHUNK) * (10 * 1024 // per_row) + 10 * 1024 // 96, r.rows_per_rank
    say("memory", r.rows_per_rank, peak)
r = pipeline(fn, npy, balance="memory", memory="1M,1M,16")  # no room at all on rank 2: the others take its rows
if comm.rank == 0:
    assert r.rows_per_rank[2] == 0 and np.array_equal(r.output, reference), r.rows_per_rank
message = raised(lambda: pipeline(fn, npy, balance="memory", memory="16"))
assert "no rank has memory for one row" in message and "give a larger budget" in message, message

# 4. speed: rank 1 takes four times as long per row; speed gives it fewer rows, same bytes. The delays are
# sleeps of about 0.6 and 0.15 s in all, far above what a busy machine adds to the rest of a rank's round
# (at 40 and 13 us a row, 67 ms in all, a run beside other jobs once gave rank 1 more rows than rank 0)
def slow_on_1(block):
    out = fn(block)
    time.sleep(block.shape[0] * (360e-6 if comm.rank == 1 else 90e-6))
    return out


even = pipeline(slow_on_1, npy, output=work / "even.npy", chunk_rows=CHUNK, balance="even")
speed = pipeline(slow_on_1, npy, output=work / "speed.npy", chunk_rows=CHUNK, balance="speed")
if comm.rank == 0:
    assert np.array_equal(np.load(work / "speed.npy"), reference)
    assert min(even.rows_per_rank) >= ROWS // 3 - 10, even.rows_per_rank
    assert speed.rows_per_rank[1] < 0.7 * speed.rows_per_rank[0], speed.rows_per_rank
    say("speed", even.rows_per_rank, speed.rows_per_rank, f"{even.total_s:.2f}", f"{speed.total_s:.2f}")

# 5. resume after a failure in the fourth round: the journal and .partial stay; resume finishes them
out = work / "resumed.npy"
calls = [0]


def fails_once(block):
    calls[0] += 1
    if comm.rank == 1 and calls[0] == 4 and not os.environ.get("NO_FAIL"):
        raise RuntimeError("lost the node")
    return fn(block)


message = raised(lambda: pipeline(fails_once, npy, output=out, chunk_rows=CHUNK, resume=True, task="standardize"))
assert "lost the node" in message, message
journal = Path(f"{out}.journal")
assert journal.exists() and Path(f"{out}.partial").exists() and not out.exists()
message = raised(lambda: pipeline(fn, npy, output=out, chunk_rows=CHUNK, task="standardize"), PipelineJournalError)
assert "resume=True" in message and "to start over" in message, message
message = raised(lambda: pipeline(fn, npy, output=out, resume=True, task="copy"), PipelineJournalError)
assert "task: the journal has 'standardize', this run 'copy'" in message, message
message = raised(lambda: pipeline(fn, csv, output=out, resume=True, task="standardize"), PipelineJournalError)
assert "input: the journal has" in message, message
os.environ["NO_FAIL"] = "1"
r = pipeline(fails_once, npy, output=out, chunk_rows=500, resume=True, task="standardize")
if comm.rank == 0:
    assert np.array_equal(np.load(out), reference) and not journal.exists()
    assert r.resumed_rows == 3 * CHUNK and r.resumed_rounds == 3, (r.resumed_rows, r.resumed_rounds)
    assert r.rows_processed == ROWS - 3 * CHUNK and r.checksum == crc.of(reference), r.summary()
    assert "resumed at row 2100" in r.summary()
    say("resume", r.resumed_rows, r.rows_processed)
# a .partial changed since the journal was written is refused, naming the rows
os.environ.pop("NO_FAIL")
calls[0] = 0
tamper = work / "tamper.npy"
raised(lambda: pipeline(fails_once, npy, output=tamper, chunk_rows=CHUNK, resume=True, task="t"))
if comm.rank == 0:
    with open(f"{tamper}.partial", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        end = f.tell()
        f.seek(200)
        f.write(b"\xff")
comm.barrier()
message = raised(lambda: pipeline(fn, npy, output=tamper, chunk_rows=CHUNK, resume=True, task="t"), PipelineJournalError)
assert "rows 0 to 700" in message and "changed since" in message, message

if comm.rank == 0:
    print(f"MODES OK size {comm.size}", flush=True)
