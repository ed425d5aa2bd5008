"""Scatter a table from rank 0, run a per-record task on every rank, gather the results.

\b
    mpirun -n 8 python jobs/scatter_gather.py                  # a million synthetic rows, mlp
    spmd run -n 4 jobs/scatter_gather.py --task standardize --verify
    mpirun -n 8 python jobs/scatter_gather.py --input data/ --output out.npy --chunk-rows 200000


    mpirun -n 4 python jobs/scatter_gather.py --output out.npy --resume --balance speed

The input (a .npy file, a .csv file, a directory of .npy shards, Parquet,
HDF5 or Zarr, or by default a synthetic table made from --seed) is processed in rounds of
--chunk-rows rows. Every rank reads its own rows where it can (a .npy
file, shards, the synthetic table; rank 0 reads a .csv and scatters it:
--read), the next round is read while this one is computed, each rank
writes its rows into --output at their offsets where it can see the
file (--write), and every block's record count and checksum are checked
both ways. --balance shares each round out evenly, by each rank's free
memory (or --memory-budget), or by each rank's measured speed.
--resume keeps a journal beside --output; after a crash the same
command with --resume continues at the first unfinished round, at any
world size. The output is bitwise identical at every world size,
chunking, balance and mode; --verify recomputes every round serially on
rank 0 and exits with status 1 if anything differs.
"""

import sys
import time

import click

from spmd import comm, run_command
from spmd.runtime import preempt
from spmd.pipeline import tasks
from spmd.pipeline.balance import MODES as BALANCES
from spmd.errors import PipelinePreempted
from spmd.pipeline.outputs import Output
from spmd.pipeline.sinks import check_output
from spmd.util.clock import process_age
from spmd.pipeline.run import READS, WRITES, PipelineError, SyntheticTable, on_root, open_source, pipeline

DEFAULT_ROWS = 1_000_000


def open_input(path, rows, features, seed, output=None, columns=None, dataset=None):
    """Return the source to read: the file or directory at path, else a synthetic table.
    A wrong output path is found first, before any input is read."""
    if output is not None:
        check_output(output)
    if path is None:
        return SyntheticTable(DEFAULT_ROWS if rows is None else rows, features, seed)
    return open_source(path, columns=columns, dataset=dataset)


def discard(start, block):
    """An output that keeps nothing (the checksum is still computed)."""


def output_of(output, row_group_rows, zarr_chunk_rows):
    """--output with its format's options (spmd.pipeline.outputs.Output), or None."""
    options = {}
    if row_group_rows is not None:
        if not (output and output.endswith(".parquet")):
            raise click.UsageError("--row-group-rows sets a Parquet output's row groups: give --output FILE.parquet")
        if row_group_rows != "round" and not (row_group_rows.isdigit() and int(row_group_rows) > 0):
            raise click.UsageError(f"--row-group-rows {row_group_rows}: give rows (a whole number above 0) or round")
        options["row_group_rows"] = "round" if row_group_rows == "round" else int(row_group_rows)
    if zarr_chunk_rows is not None:
        if not (output and output.rstrip("/").endswith(".zarr")):
            raise click.UsageError("--zarr-chunk-rows sets a Zarr output's chunks: give --output STORE.zarr")
        options["chunk_rows"] = zarr_chunk_rows
    return Output(output, **options) if options else output


@click.command(help=__doc__)
@click.option("--input", "input_path", type=click.Path(), metavar="PATH",
              help="A .npy or .csv file, a directory of .npy shards, a .parquet file or directory, "
                   "FILE.h5:/DATASET or a .zarr store [default: synthetic].")
@click.option("--columns", metavar="A,B,...", help="Parquet input: the columns to read, in this order [default: all].")
@click.option("--dataset", metavar="/PATH", help="HDF5 input: the dataset (or FILE.h5:/PATH) [default: the only one].")
@click.option("--rows", type=click.IntRange(min=0),
              help=f"Rows of the synthetic table [default: {DEFAULT_ROWS}].")
@click.option("--features", type=click.IntRange(min=1), default=16, show_default=True,
              help="Columns of the synthetic table.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the synthetic table and of the task's weights.")
@click.option("--task", type=click.Choice(tasks.names()), default="mlp", show_default=True,
              help="The per-record computation: "
                   + "; ".join(f"{t.name}: {t.help.rstrip('.')}" for t in map(tasks.get, tasks.names())) + ".")
@click.option("--output", type=click.Path(), metavar="PATH",
              help="Write the results here: .npy, .parquet, FILE.h5:/DATASET or .zarr [default: keep only the checksum].")
@click.option("--row-group-rows", metavar="N|round",
              help="Parquet output: rows per row group, or 'round' for one per round [default: about 64 MiB].")
@click.option("--zarr-chunk-rows", type=click.IntRange(min=1), metavar="N",
              help="Zarr output: rows per chunk, each written whole by one rank [default: a sixteenth of the rows, "
                   "64 KiB to 4 MiB].")
@click.option("--chunk-rows", type=click.IntRange(min=1), default=131072, show_default=True,
              help="Rows rank 0 reads and scatters per round; bounds its memory.")
@click.option("--read", type=click.Choice(READS), default="auto", show_default=True,
              help="parallel: every rank reads its own rows; root: rank 0 reads and scatters; auto: parallel where possible.")
@click.option("--write", type=click.Choice(WRITES), default="auto", show_default=True,
              help="parallel: every rank writes its rows into --output; root: rank 0 gathers and writes; auto: parallel where possible.")
@click.option("--balance", type=click.Choice(BALANCES), default="even", show_default=True,
              help="Share each round evenly, capped by each rank's memory, or by each rank's measured speed.")
@click.option("--memory-budget", metavar="SIZE[,SIZE...]",
              help="Bytes each rank may hold in rows (512M, 2G; one per rank, the last repeats) [default: free memory].")
@click.option("--resume", is_flag=True,
              help="Keep a journal beside --output and continue an interrupted run from its first unfinished round.")
@click.option("--overlap/--no-overlap", default=True, show_default=True,
              help="Read the next round and write the last one while this one is computed.")
@click.option("--verify", is_flag=True, help="Recompute every round serially on rank 0 and compare.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on stderr [default: when stderr is a terminal].")
@click.option("--quiet", is_flag=True, help="Print nothing but errors.")
def main(input_path, columns, dataset, rows, features, seed, task, output, row_group_rows, zarr_chunk_rows,
         chunk_rows, read, write, balance, memory_budget, resume, overlap, verify, progress, quiet):
    if input_path is not None and rows is not None:
        raise click.UsageError("--rows sets the size of the synthetic table; it cannot be used with --input")
    if resume and not output:
        raise click.UsageError("--resume needs --output PATH: the journal records the rounds written there")
    target = output_of(output, row_group_rows, zarr_chunk_rows)
    if resume:
        preempt.install()  # a preemption signal ends the run at a round's end, journal up to date
    show_progress = not quiet and (sys.stderr.isatty() if progress is None else progress)
    try:
        import torch  # noqa: F401 - the tasks run on it: its import is start-up, not work
        startup = comm.gather_object(process_age(), root=0)  # python, imports, spmd.init on each rank
        started = time.perf_counter()
        picked = [c.strip() for c in columns.split(",") if c.strip()] if columns else None
        source = on_root(lambda: open_input(input_path, rows, features, seed, output, picked, dataset))
        fn = tasks.build(task, source, seed=seed)
        prepared = time.perf_counter() - started
        result = pipeline(fn, source, output=target or discard, chunk_rows=chunk_rows, verify=verify,
                          progress=show_progress, read=read, write=write, balance=balance,
                          memory=memory_budget, resume=resume, overlap=overlap)
    except PipelinePreempted as exc:  # the journal is up to date: the requeued job resumes
        if comm.rank == 0:
            print(str(exc), file=sys.stderr, flush=True)
        sys.exit(0)
    except PipelineError as exc:  # raised alike on every rank: say it once
        if comm.rank == 0:
            raise click.ClickException(str(exc)) from None
        sys.exit(1)
    if result is None:
        return
    if not quiet:
        up = f"start-up {max(startup):.3f} s (the slowest rank's python, import torch and spmd.init); " \
            if startup and None not in startup else ""
        print(f"task {task} on {source!r}; {up}input and task ready in {prepared:.3f} s")
        print(result.summary())
        if output:
            print(f"wrote {output}")
    if verify and not result.verified:
        sys.exit(f"verification failed: {result.mismatched_rows} of {result.rows} rows differ "
                 f"from the serial recomputation (first: row {result.first_mismatch})")


if __name__ == "__main__":
    run_command(main)  # a bad option: said once, every rank exits 2
