"""Scatter, process, gather: apply a per-record function to a table on every rank.

The input is cut into rounds of ``chunk_rows`` rows; each round's rows
are shared out over the ranks (``balance``), every rank applies ``fn``
to its block, and the results are put in row order into the output,
checked on the way (record counts and checksums of every block, both
ways) and optionally recomputed serially on root::

    from spmd import comm
    from spmd.pipeline.run import pipeline

    def fn(block):                        # one output row per input row
        return block * 2.0

    result = pipeline(fn, "table.npy", output="doubled.npy", chunk_rows=100_000)
    if comm.rank == 0:                    # the Result lives on root
        print(result.summary())

Run it with ``mpirun -n 8 python mine.py`` or ``spmd run -n 8 mine.py``,
or plain python for a world of one. The input (given on root; other
ranks may pass None) is an array, a path (.npy file, directory of .npy
shards, .csv), a source object with ``shape``, ``dtype`` and
``read(start, stop)`` such as :class:`SyntheticTable`, or a callable
returning one of these, called on root only.

How rows move (the Result and ``summary()`` say which was used):

read
    ``"parallel"``: every rank reads its own rows from its own copy of
    the source, for sources that say every rank can read them
    (``every_rank = True``: .npy files and shard folders on a shared
    file system, synthetic tables) and open on every rank. ``"root"``:
    root reads each round and scatters it (an array in root's memory, a
    .csv file, a callable's object). ``"auto"`` (default): parallel
    where it works, else root.
write
    For a .npy output, ``"parallel"``: every rank writes its rows at
    their offsets in the output file, when every rank can open the file
    root made; ``"root"``: results are gathered to root, which writes
    them. ``"auto"``: parallel where it works. Other outputs (None: an
    array returned on root; a callable(start_row, block)) are gathered.
overlap
    Reading the next round and root's writing of the last one run in
    threads beside fn (default True); at most two rounds are in memory.
balance
    ``"even"``, ``"memory"`` or ``"speed"`` (:mod:`spmd.pipeline.balance`);
    ``memory=`` gives each rank's budget (bytes, "512M", or one per rank
    "2G,512M").
resume
    With a .npy output, keep a journal (``<output>.journal``) and the
    unfinished output (``<output>.partial``), so that after a crash the
    same call with resume=True continues at the first unfinished round,
    at any world size (:mod:`spmd.pipeline.journal`). Without resume an existing
    journal is an error that says what to do.

Every mode writes the same bytes. For an output that is bitwise
identical at every world size, chunking and balance, ``fn`` must compute
each row independently of how rows are batched;
:func:`spmd.tasks.fixed_batches` makes that easy.

This module does not import torch; ``fn`` may return tensors.
"""

from spmd.pipeline.balance import MODES as BALANCES
from spmd.errors import PipelineError, PipelineJournalError, PipelineTypeError, PipelineValueError
from spmd.pipeline.journal import journal_path
from spmd.pipeline.progress import PHASES, Laps, Result
from spmd.pipeline.ranks import Ranks
from spmd.pipeline.root import Root
from spmd.pipeline.rounds import describe
from spmd.pipeline.sources import ArraySource, CsvSource, NpySource, ShardSource, SyntheticTable, open_source

__all__ = [
    "pipeline",
    "Result",
    "PipelineError",
    "on_root",
    "open_source",
    "ArraySource",
    "NpySource",
    "ShardSource",
    "CsvSource",
    "SyntheticTable",
    "PHASES",
    "READS",
    "WRITES",
    "BALANCES",
]

READS = ("auto", "parallel", "root")
_ERRORS = {e.__name__: e for e in (PipelineError, PipelineJournalError, PipelineValueError, PipelineTypeError)}
WRITES = ("auto", "parallel", "root")


def _comm(comm):
    if comm is not None:
        return comm
    from spmd import comm as world

    return world


def on_root(work, *, comm=None, root=0, share=False):
    """Run ``work()`` on root alone and raise the same error everywhere if it fails.

    Returns work()'s value on root and None elsewhere, or root's value on
    every rank with ``share=True`` (it must then pickle). Every rank
    must call on_root, so a failure on root never leaves the others
    waiting in the next collective.
    """
    comm = _comm(comm)
    value = error = None
    if comm.rank == root:
        try:
            value = work()
        except Exception as exc:
            error = describe(exc)
    reply = comm.broadcast_object(("error", error) if error else ("ok", value if share else None), root)
    if reply[0] == "error":
        raise PipelineError(f"on rank {root}: {reply[1]}")
    return value if comm.rank == root else reply[1]


def _choice(name, value, allowed):
    if value not in allowed:
        raise PipelineValueError(f"{name}={value!r}: expected one of {', '.join(map(repr, allowed))}")


def pipeline(fn, source, *, output=None, chunk_rows=None, verify=False, progress=None, comm=None, root=0,
             read="auto", write="auto", balance="even", memory=None, resume=False, task=None, overlap=True):
    """Share the rows of source over the ranks, apply fn on every rank, put the results in output.

    fn(block) -> array with one row per row of block (a numpy array or a
    torch tensor; every rank's must agree in dtype and row shape). It
    also gets empty blocks, when a round has fewer rows than ranks.

    source (used on root only): an array, a path, a source object, or a
    callable returning one of these. output: None to return the results
    as one array on root, a .npy path (made whole-sized, filled in, put
    in place when complete), or a callable(start_row, block) on root.
    chunk_rows: rows per round (default: all at once). verify: recompute
    each round serially on root and compare bitwise (results then go to
    root). progress: True for a bar on stderr, or a callable(done_rows,
    total_rows). read, write, overlap, balance, memory, resume: see the
    module's docstring. task: what a resume journal records as the task
    (default: fn's ``spmd_task``, set by spmd.tasks.build, else its name).

    Returns a :class:`Result` on root and None on other ranks. Raises
    PipelineError on every rank if anything fails on any rank.
    """
    comm = _comm(comm)
    _choice("read", read, READS)
    _choice("write", write, WRITES)
    _choice("balance", balance, BALANCES)
    lap = Laps()
    boss = Root(comm, fn, verify, lap) if comm.rank == root else None
    plan = comm.broadcast_object(boss and boss.open(source, output, chunk_rows, progress, read, resume, task), root)
    if plan[0] != "ok":
        raise _ERRORS[plan[2]](f"pipeline: on rank {root}: {plan[1]}")
    plan = plan[1]
    plan["journal"] = journal_path(output) if plan["positional"] else None
    run = Ranks(comm, fn, root, boss, plan, lap, (read, write, balance, memory, verify, overlap))
    try:
        run.agree()
        run.rounds_loop()
        written = run.finish()
    except BaseException:
        run.abandon()
        raise
    run.close()
    if not boss:
        return None
    return Result(
        rows=plan["rows"],
        rows_out=boss.rows_out,
        ranks=comm.size,
        backend=comm.backend,
        rounds=run.rounds,
        chunk_rows=plan["chunk"],
        row_shape=tuple(run.empty.shape[1:]) if run.empty is not None else (),
        dtype=str(run.empty.dtype) if run.empty is not None else "",
        timings=lap.timings(),
        total_s=lap.total(),
        checksum=boss.out_crc,
        input_checksum=boss.in_crc,
        rows_per_rank=run.rank_rows,
        process_per_rank=run.rank_secs,
        busy_per_rank=run.rank_busy,
        output=written,
        verified=(boss.mismatched == 0) if verify else None,
        mismatched_rows=boss.mismatched,
        first_mismatch=boss.first_bad,
        checksum_kind=run.crc.name,
        read_mode=run.read_mode,
        write_mode=run.write_mode or ("memory" if output is None else "callable"),
        balance=balance,
        overlap=bool(overlap),
        resumed_rows=plan["start"],
        resumed_rounds=plan["rounds_before"],
        notes=tuple(run.notes),
    )
