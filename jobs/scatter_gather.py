"""Scatter a table from rank 0, run a per-record task on every rank, gather the results.

\b
    mpirun -n 8 python jobs/scatter_gather.py                  # a million synthetic rows, mlp
    spmd run -n 4 jobs/scatter_gather.py --task standardize --verify
    mpirun -n 8 python jobs/scatter_gather.py --input data/ --output out.npy --chunk-rows 200000

Rank 0 reads the input (a .npy file, a .csv file, a directory of .npy
shards, or by default a synthetic table made from --seed) in rounds of
--chunk-rows rows, scatters each round's rows over the ranks, gathers
the results in row order, checks record counts and checksums, and
writes --output. The output is bitwise identical at every world size
and chunking; --verify recomputes every round serially on rank 0 and
exits with status 1 if anything differs.
"""

import sys
import time

import click

from spmd import comm, tasks
from spmd.pipeline import PipelineError, SyntheticTable, on_root, open_source, pipeline

DEFAULT_ROWS = 1_000_000


def open_input(path, rows, features, seed):
    """Return the source to read: the file or directory at path, else a synthetic table."""
    if path is None:
        return SyntheticTable(DEFAULT_ROWS if rows is None else rows, features, seed)
    return open_source(path)


def discard(start, block):
    """An output that keeps nothing (the checksum is still computed)."""


@click.command(help=__doc__)
@click.option("--input", "input_path", type=click.Path(), metavar="PATH",
              help="A .npy file, a .csv file or a directory of .npy shards [default: synthetic].")
@click.option("--rows", type=click.IntRange(min=0),
              help=f"Rows of the synthetic table [default: {DEFAULT_ROWS}].")
@click.option("--features", type=click.IntRange(min=1), default=16, show_default=True,
              help="Columns of the synthetic table.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the synthetic table and of the task's weights.")
@click.option("--task", type=click.Choice(tasks.names()), default="mlp", show_default=True,
              help="The per-record computation: "
                   + "; ".join(f"{t.name}: {t.help.rstrip('.')}" for t in map(tasks.get, tasks.names())) + ".")
@click.option("--output", type=click.Path(dir_okay=False), metavar="FILE.npy",
              help="Write the results here (rank 0) [default: keep only the checksum].")
@click.option("--chunk-rows", type=click.IntRange(min=1), default=131072, show_default=True,
              help="Rows rank 0 reads and scatters per round; bounds its memory.")
@click.option("--verify", is_flag=True, help="Recompute every round serially on rank 0 and compare.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on stderr [default: when stderr is a terminal].")
@click.option("--quiet", is_flag=True, help="Print nothing but errors.")
def main(input_path, rows, features, seed, task, output, chunk_rows, verify, progress, quiet):
    if input_path is not None and rows is not None:
        raise click.UsageError("--rows sets the size of the synthetic table; it cannot be used with --input")
    started = time.perf_counter()
    show_progress = not quiet and (sys.stderr.isatty() if progress is None else progress)
    try:
        source = on_root(lambda: open_input(input_path, rows, features, seed))
        fn = tasks.build(task, source, seed=seed)
        prepared = time.perf_counter() - started
        result = pipeline(fn, source, output=output or discard, chunk_rows=chunk_rows,
                          verify=verify, progress=show_progress)
    except PipelineError as exc:  # raised alike on every rank: say it once
        if comm.rank == 0:
            raise click.ClickException(str(exc)) from None
        sys.exit(1)
    if result is None:
        return
    if not quiet:
        print(f"task {task} on {source!r}; prepared in {prepared:.3f} s")
        print(result.summary())
        if output:
            print(f"wrote {output}")
    if verify and not result.verified:
        sys.exit(f"verification failed: {result.mismatched_rows} of {result.rows} rows differ "
                 f"from the serial recomputation (first: row {result.first_mismatch})")


if __name__ == "__main__":
    main()
