"""``spmd bench collectives`` and ``spmd bench memory``: measurements in a launched world of every implementation."""

import os
import sys
import time
import traceback

import click

from spmd.bench.cases import ALL, COLLECTIVES, EXTRAS, MESSAGES
from spmd.cli.bench.options import (POSITIVE, json_option, names, quiet_option, relaunch, start_world,
                                    world_options, write)

__all__ = ["collectives", "memory"]


# -- the collectives ---------------------------------------------------------------------------


@click.command(short_help="Every collective: spmd's backends beside raw mpi4py and gloo.")
@world_options
@json_option
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Write a PNG of busbw against size (needs matplotlib).")
@click.option("--collectives", default=",".join(COLLECTIVES + EXTRAS), show_default=True,
              help=f"Comma-separated list; also {', '.join(MESSAGES)} (point to point and the later collectives).")
@click.option("--impls", help="Comma-separated subset of spmd-mpi, mpi4py, spmd-gloo, gloo (also "
              "mpi4py-torchbuf: raw mpi4py on torch-allocated memory) [default: all available].")
@click.option("--sizes", help="Exact sizes, comma-separated: 8,1K,1M (binary units).")
@click.option("--min-size", default="8", show_default=True, help="Smallest size of the sweep.")
@click.option("--max-size", default="256M", show_default=True, help="Largest size of the sweep.")
@click.option("--factor", default=4, show_default=True, type=click.IntRange(min=2), help="Step of the sweep.")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(min=1),
              help="Rounds; each implementation takes a turn per size per round.")
@click.option("--target-time", "target", default=0.1, show_default=True, type=POSITIVE,
              help="Seconds of samples per implementation, size and round.")
@click.option("--many", default="200x4K", show_default=True, help="all_reduce_many: COUNTxBYTES tensors.")
@click.option("--spread", is_flag=True, help="Show p10-p90 in the table.")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Check each implementation's result first.")
@quiet_option
@click.option("--alone", is_flag=True, help="Run in a world of one, without a launcher (MPI.COMM_SELF and "
              "a one-rank gloo group): spmd minus raw is then each wrapper's own cost per call.")
@click.option("--cpu-clock", is_flag=True, help="With --alone: time with this process's CPU clock "
              "(all its threads), which other jobs on the machine barely disturb.")
@click.pass_context
def collectives(ctx, **opts):
    """Time the six collectives (and uneven chunks, and a list of small
    tensors) on spmd's mpi and gloo backends against raw mpi4py and raw
    torch.distributed gloo, in the same processes, interleaved in rounds.

    Prints a table on rank 0 (median time per call and busbw), and
    writes JSON and a plot when asked.  Example:

        mpirun -n 2 spmd bench collectives --max-size 64M --json out.json --plot out.png
    """
    settings = _settings(opts)
    if opts["cpu_clock"] and not opts["alone"]:
        raise click.UsageError("--cpu-clock needs --alone: with peers, waiting for them takes no CPU")
    settings.clock = "cpu" if opts["cpu_clock"] else "wall"
    if opts["launch"]:
        if opts["alone"]:
            raise click.UsageError("--alone runs in this process; leave out --launch")
        sys.exit(relaunch(ctx, opts["launch"]))
    _sweep(settings, opts)


def _settings(opts):
    from spmd.bench import IMPLS, Settings, default_sizes, parse_size

    try:
        if opts["sizes"]:
            sizes = tuple(sorted({parse_size(s) for s in opts["sizes"].split(",") if s.strip()}))
        else:
            sizes = default_sizes(parse_size(opts["min_size"]), parse_size(opts["max_size"]), opts["factor"])
        count, _, each = opts["many"].lower().partition("x")
        many = (int(count), parse_size(each))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    impls = opts["impls"]
    return Settings(
        collectives=names(opts["collectives"], ALL, "collective"),
        sizes=sizes,
        impls=names(impls, IMPLS + ("mpi4py-torchbuf",), "implementation") if impls else None,
        rounds=opts["rounds"],
        target=opts["target"],
        many=many,
        verify=opts["verify"],
    )


def _sweep(settings, opts):
    from spmd.bench import run
    from spmd.bench.report import document, meta, plot, summary, summary_table, table

    started, load, thp = time.time(), list(os.getloadavg()), os.environ.get("THP_MEM_ALLOC_ENABLE")
    world = start_world(opts["alone"], opts["backends"], opts["threads"])
    lead = world.rank == 0

    def progress(row):
        click.echo(f"  {row['collective']:<16}{row['impl']:<20}{row['size']:>11} B "
                   f"{row['time_us']:>12.1f} us", err=True)

    try:
        rows = run(world, settings, None if opts["quiet"] or not lead else progress)
        info = meta(world, settings, started, load_start=load, thp_env_start=thp)
    except BaseException:
        if world.size > 1 and world.mpi is not None:  # peers may wait forever: end the job
            from spmd.runtime.start import abort_job

            traceback.print_exc()
            abort_job(1)  # as a failing rank of any spmd job: flush, a moment, MPI_Abort
        raise
    world.close()
    if not lead:
        return
    click.echo(table(rows, opts["spread"]))
    click.echo(summary_table(summary(rows)))
    write(opts["json_path"], document(rows, info))
    if opts["plot_path"]:
        try:
            plot(rows, opts["plot_path"], f"spmd bench, {world.size} ranks on {info['hosts'][0]}")
        except RuntimeError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"wrote {opts['plot_path']}", err=True)


# -- memory ------------------------------------------------------------------------------------


@click.command(short_help="The extra memory of one all_reduce, whole and in chunks.")
@world_options
@json_option
@click.option("--size", default="256M", show_default=True, help="The all_reduce's bytes.")
@click.option("--chunk", default="1M", show_default=True, help="The chunk_bytes to compare with one whole call.")
@click.pass_context
def memory(ctx, launch, backends, threads, json_path, size, chunk):
    """The extra peak memory of one all_reduce, whole and with chunk_bytes=--chunk.

    Runs in a launched world (Linux: it resets and reads each rank's peak
    resident size).  Example:

        spmd bench memory --launch 2 --size 256M --chunk 1M
    """
    from spmd.bench import memory as mem
    from spmd.bench import parse_size

    try:
        nbytes, chunk_bytes = parse_size(size), parse_size(chunk)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if launch:
        sys.exit(relaunch(ctx, launch))
    if not mem.available():
        raise click.ClickException("spmd bench memory needs Linux's /proc/self/clear_refs and VmHWM")
    world = start_world(False, backends, threads)
    rows = mem.measure(world, nbytes, chunk_bytes)
    world.close()
    if world.rank != 0:
        return
    click.echo(mem.memory_table(rows))
    write(json_path, {"schema": "spmd-bench-memory/1", "rows": rows})
