"""Scatter, process, gather: apply a per-record function to a table on every rank.

:func:`pipeline` cuts the input into rounds of ``chunk_rows`` rows,
shares each round out over the ranks, applies ``fn`` to every rank's
block and puts the results in row order into the output, checked on
the way; :func:`on_root` runs a step on root alone and raises its
failure everywhere. Root decides the :class:`spmd.pipeline.plan.Plan`
(:mod:`spmd.pipeline.root`), every rank runs the rounds
(:mod:`spmd.pipeline.ranks`). docs/pipeline.md says what the inputs,
outputs and the read, write, overlap, balance and resume modes are, with
an example. This module does not import torch; ``fn`` may return tensors.
"""


from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from spmd.errors import PipelineError, PipelineJournalError, PipelineTypeError, PipelineValueError
from spmd.pipeline.balance import MODES as BALANCES
from spmd.pipeline.formats.extra import warm
from spmd.pipeline.formats.names import libraries
from spmd.pipeline.journal import journal_path
from spmd.pipeline.outputs import Output
from spmd.pipeline.plan import Options
from spmd.pipeline.progress import PHASES, Laps, Result
from spmd.pipeline.roles import one_rank
from spmd.pipeline.root import Root
from spmd.pipeline.rounds import describe
from spmd.pipeline.sources import ArraySource, CsvSource, NpySource, ShardSource, SyntheticTable, open_source

if TYPE_CHECKING:
    from spmd import Comm

__all__ = [
    "pipeline",
    "Output",
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


def on_root(work: Callable[[], Any], *, comm: Optional[Comm] = None, root: int = 0, share: bool = False) -> Any:
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


def pipeline(fn: Callable[[Any], Any], source: Any, *, output: Any = None, chunk_rows: Optional[int] = None,
             verify: bool = False, progress: Union[bool, Callable[[int, int], Any], None] = None,
             comm: Optional[Comm] = None, root: int = 0, read: str = "auto", write: str = "auto",
             balance: str = "even", memory: Any = None, resume: bool = False, task: Optional[str] = None,
             overlap: bool = True) -> Optional[Result]:
    """Share the rows of source over the ranks, apply fn on every rank, put the results in output.

    fn(block) -> array with one row per row of block (a numpy array or a
    torch tensor; every rank's must agree in dtype and row shape). It
    also gets empty blocks, when a round has fewer rows than ranks.

    source (used on root only): an array, a path, a source object, or a
    callable returning one of these. output: None to return the results
    as one array on root, a .npy path (made whole-sized, filled in, put
    in place when complete; or .parquet, .h5, .zarr; an :class:`Output`
    adds its format's options), or a callable(start_row, block) on root.
    chunk_rows: rows per round (default: all at once). verify: recompute
    each round serially on root and compare bitwise (results then go to
    root). progress: True for a bar on stderr, or a callable(done_rows,
    total_rows). read, write, overlap, balance, memory, resume: see
    docs/pipeline.md. task: what a resume journal records as the task
    (default: fn's ``spmd_task``, set by spmd.tasks.build, else its name).

    Returns a :class:`Result` on root and None on other ranks. Raises
    PipelineError on every rank if anything fails on any rank.
    """
    comm = _comm(comm)
    _choice("read", read, READS)
    _choice("write", write, WRITES)
    _choice("balance", balance, BALANCES)
    options = Options(read=read, write=write, balance=balance, memory=memory, verify=verify, overlap=overlap)
    lap = Laps()
    # every rank imports the formats' libraries while root opens the input (not one after the other); the
    # others finish before they wait for root's reply: a rank waiting in an MPI call polls, a core's worth of
    # CPU beside its own import (a 1M-row Zarr run on 2 cores: 0.472 s against 0.498 s, docs/performance.md)
    warm(comm.broadcast_object(libraries(source, output) if comm.rank == root else None, root),
         wait=comm.rank != root)
    books = Root(comm, fn, options, lap) if comm.rank == root else None
    reply = comm.broadcast_object(books and books.open(source, output, chunk_rows, progress, read, resume, task),
                                  root)
    if reply[0] != "ok":
        raise _ERRORS[reply[2]](f"pipeline: on rank {root}: {reply[1]}")
    plan = replace(reply[1], journal=journal_path(output) if reply[1].positional else None)
    run = one_rank(comm, fn, root, books, plan, lap, options)
    try:
        run.agree()
        run.rounds_loop()
        written = run.finish()
    except BaseException:
        run.abandon()
        raise
    run.close()
    if not books:
        return None
    return _result(comm, plan, options, books, run, lap, written, output)


def _result(comm, plan, options, books, run, lap, written, output):
    """Root's Result of a finished run."""
    return Result(
        rows=plan.rows,
        rows_out=books.rows_out,
        ranks=comm.size,
        backend=comm.backend,
        rounds=run.rounds,
        chunk_rows=plan.chunk,
        row_shape=tuple(run.empty.shape[1:]) if run.empty is not None else (),
        dtype=str(run.empty.dtype) if run.empty is not None else "",
        timings=lap.timings(),
        total_s=lap.total(),
        checksum=books.out_crc,
        input_checksum=books.in_crc,
        rows_per_rank=run.per_rank.rows,
        process_per_rank=run.per_rank.seconds,
        busy_per_rank=run.per_rank.busy,
        output=written,
        verified=(books.mismatched == 0) if options.verify else None,
        mismatched_rows=books.mismatched,
        first_mismatch=books.first_bad,
        checksum_kind=run.crc.name,
        read_mode=run.read_mode,
        write_mode=run.write_mode or ("memory" if output is None else "callable"),
        balance=options.balance,
        overlap=bool(options.overlap),
        resumed_rows=plan.start,
        resumed_rounds=plan.rounds_before,
        notes=tuple(run.notes) + ((f"shares and rounds end on {plan.grid.why}",)
                                  if plan.grid and comm.size > 1 else ()),
    )
