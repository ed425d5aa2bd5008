"""``spmd bench startup``, ``preload``, ``pipeline`` and ``train``: measurements made of separate launches."""

import os
import subprocess

import click

from spmd.cli.bench.options import (counts, json_option, names, progress_lines, quiet_option, repeats_option,
                                    write)
from spmd.errors import SpmdError

__all__ = ["startup", "preload", "pipeline", "train"]


# -- start-up ----------------------------------------------------------------------------------


@click.command(short_help="Where a job's start-up time goes.")
@click.option("--ranks", default=8, show_default=True, type=click.IntRange(min=1), help="Ranks of each launch.")
@repeats_option(5, "Launches per scenario.")
@click.option("--script", type=click.Path(exists=True, dir_okay=False),
              help="Time to the first collective of this script "
                   "[default: jobs/scatter_gather.py, else jobs/collectives.py, if present].")
@json_option
@quiet_option
def startup(ranks, repeats, script, json_path, quiet):
    """Where start-up time goes: separate mpirun launches (not under a launcher).

    Example: spmd bench startup --ranks 8 --repeats 5
    """
    from spmd.bench.startup import measure, startup_table

    if script is None:
        script = next((c for c in ("jobs/scatter_gather.py", "jobs/collectives.py") if os.path.exists(c)), None)
    try:
        rows = measure(ranks, repeats, script and os.path.abspath(script), progress=progress_lines(quiet))
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(startup_table(rows))
    write(json_path, {"schema": "spmd-bench-startup/1", "load_average": list(os.getloadavg()), "startup": rows})


@click.command(short_help="What spmd run --preload saves.")
@click.argument("modules", default="torch")
@click.option("--ranks", default=8, show_default=True, type=click.IntRange(min=1), help="Ranks of each launch.")
@repeats_option(3, "Launches per scenario.")
@click.option("--script", type=click.Path(exists=True, dir_okay=False),
              help="The job whose first collective is timed [default: jobs/scatter_gather.py].")
@json_option
@quiet_option
def preload(modules, ranks, repeats, script, json_path, quiet):
    """What spmd run --preload MODULES saves (comma-separated, default torch).

    The job's first collective and wall against an empty script, spmd run
    without preload and mpirun; separate launches.  Example:

        spmd bench preload torch --ranks 8 --repeats 5
    """
    from spmd.bench import preload as pre

    names = [m.strip() for m in modules.split(",") if m.strip()]
    try:
        results = pre.measure(ranks, repeats, script, (), names, log=progress_lines(quiet))
    except (SpmdError, subprocess.TimeoutExpired) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(pre.report(results, ranks))
    write(json_path, {"schema": "spmd-bench-preload/1", "modules": names, "results": results})


# -- the pipeline and training -----------------------------------------------------------------


@click.command(short_help="spmd.pipeline beside an mpi4py loop, Pool and MPIPoolExecutor.")
@click.option("--ranks", default="1,2,4,8", show_default=True, callback=counts, help="Rank counts.")
@repeats_option(3, "Launches per case.")
@click.option("--scenarios", default="table", show_default=True,
              help="Comma-separated table (every case at every rank count), busy (balance even against "
                   "speed beside a busy process), memory (root's peak at --memory-rows).")
@click.option("--rows", default=1_000_000, show_default=True, type=click.IntRange(min=1), help="Input rows.")
@click.option("--busy-procs", default=1, show_default=True, type=click.IntRange(min=1),
              help="busy scenario: spinning processes on rank 1's core.")
@click.option("--memory-rows", default="1000000,10000000", show_default=True, callback=counts,
              help="memory scenario: input sizes.")
@json_option
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Write a PNG of the table scenario (needs matplotlib).")
@quiet_option
def pipeline(ranks, repeats, scenarios, rows, busy_procs, memory_rows, json_path, plot_path, quiet):
    """spmd.pipeline against an mpi4py loop, Pool.imap and MPIPoolExecutor: separate launches.

    Example: spmd bench pipeline --repeats 3 --scenarios table,busy,memory
    """
    from spmd.bench import pipeline as pb

    chosen = names(scenarios, ("table", "busy", "memory"), "scenario")
    progress = progress_lines(quiet)
    doc = {"schema": "spmd-bench-pipeline/1", "load_average_start": list(os.getloadavg()), "rows": rows,
           "chunk_rows": pb.CHUNK}
    try:
        if "table" in chosen:
            doc["table"] = pb.measure(ranks, repeats, rows, progress=progress)
            click.echo(pb.table(doc["table"]))
            if plot_path:
                pb.plot(doc["table"], plot_path, f"spmd bench pipeline: {rows:,} rows, mlp, {os.cpu_count()} cores")
                click.echo(f"wrote {plot_path}", err=True)
        if "busy" in chosen:
            doc["busy"] = pb.busy(repeats, rows, progress=progress, spinners=busy_procs)
            click.echo(pb.busy_table(doc["busy"]))
        if "memory" in chosen:
            doc["memory"] = pb.memory(memory_rows, progress=progress)
            click.echo(pb.memory_table(doc["memory"]))
    except (SpmdError, subprocess.TimeoutExpired) as exc:
        raise click.ClickException(str(exc)) from None
    doc["load_average_end"] = list(os.getloadavg())
    write(json_path, doc)


@click.command(short_help="DataParallel beside torch's DistributedDataParallel.")
@click.option("--ranks", default="1,2,4", show_default=True, callback=counts, help="Rank counts.")
@repeats_option(5, "Launches per case and rank count.")
@click.option("--vocab", type=click.IntRange(min=2),
              help="The model's vocabulary [default: jobs/train_dp.py's, 32; BERT's is 30522]. The "
                   "embedding's gradient as rows beside DDP: python -m spmd.bench.embedding.")
@json_option
@quiet_option
def train(ranks, repeats, vocab, json_path, quiet):
    """DataParallel on gloo and mpi (plain, overlap, bf16) beside torch's DistributedDataParallel.

    Separate launches of jobs/train_dp.py's model (spmd.bench.train).  Example:

        spmd bench train --repeats 5 --json train.json
    """
    from spmd.bench import train as tb

    try:
        doc = tb.bench(ranks, repeats, model={"vocab": vocab} if vocab else None, progress=progress_lines(quiet))
    except (SpmdError, subprocess.TimeoutExpired) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(tb.report(doc))
    write(json_path, doc)
