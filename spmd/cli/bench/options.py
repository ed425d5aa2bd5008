"""What spmd bench's subcommands share: their common options, parsing, output, and starting mpirun."""

import os
import subprocess
import sys

import click

from spmd.errors import SpmdError
from spmd.util.paths import BENCH

__all__ = ["POSITIVE", "names", "counts", "progress_lines", "write", "json_option", "quiet_option", "repeats_option",
           "world_options", "relaunch", "start_world"]

POSITIVE = click.FloatRange(min=0, min_open=True)


def names(value, allowed, what):
    """A comma-separated list of names, each one of allowed, as a tuple."""
    chosen = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [n for n in chosen if n not in allowed]
    if bad or not chosen:
        raise click.BadParameter(f"unknown {what} {', '.join(bad) or '(none)'}; choose from {', '.join(allowed)}")
    return chosen


def counts(ctx, param, value):
    """A comma-separated list of rank counts or row counts, as a tuple of ints."""
    try:
        numbers = [float(n) for n in value.split(",") if n.strip()]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    whole = tuple(int(n) for n in numbers)
    if not whole or min(whole) < 1 or whole != tuple(numbers):
        raise click.BadParameter(f"{value!r}: give positive whole numbers, comma-separated")
    return whole


def progress_lines(quiet):
    """A progress callback that prints each line to stderr, or None when quiet."""
    return None if quiet else (lambda line: click.echo(line, err=True))


def write(json_path, doc):
    """Write doc as JSON to json_path, when one was given, and say so."""
    from spmd.bench.report import write_json

    if json_path:
        write_json(json_path, doc)
        click.echo(f"wrote {json_path}", err=True)


def json_option(f):
    """--json FILE."""
    return click.option("--json", "json_path", type=click.Path(dir_okay=False),
                        help="Write the results here as JSON.")(f)


def quiet_option(f):
    """--quiet."""
    return click.option("--quiet", is_flag=True, help="No progress lines.")(f)


def repeats_option(default, what):
    """--repeats, with this subcommand's default and meaning."""
    return click.option("--repeats", default=default, show_default=True, type=click.IntRange(min=1), help=what)


def world_options(f):
    """The options of the measurements made in a launched world: --launch, --backends, --threads."""
    f = click.option("--threads", type=click.IntRange(min=1),
                     help="torch threads per rank [default: cores / ranks per node].")(f)
    f = click.option("--backends", help="mpi,gloo: the worlds to start [default: mpi,gloo under MPI, else gloo].")(f)
    return click.option("--launch", type=click.IntRange(min=2), metavar="N",
                        help="Start mpirun -n N of this command yourself (else run under a launcher).")(f)


def relaunch(ctx, ranks):
    """Run this same subcommand under mpirun -n ranks and return its exit code."""
    from spmd.bench.startup import find_mpirun

    mpirun = find_mpirun()
    if mpirun is None:
        raise click.ClickException("--launch needs mpirun: pip install mpich, or start spmd bench under your launcher")
    args = []
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        given = ctx.get_parameter_source(param.name) == click.core.ParameterSource.COMMANDLINE
        if param.name == "launch" or not given:
            continue
        if param.is_flag:
            args.append(param.opts[0] if value else param.secondary_opts[0])
        else:
            args += [param.opts[0], str(value)]
    cmd = [mpirun, "-n", str(ranks), sys.executable, "-m", BENCH, ctx.info_name] + args
    click.echo("running: " + " ".join(cmd), err=True)
    return subprocess.call(cmd)


def start_world(alone, backends, threads):
    """Open the benchmark's world (every implementation in these processes), or say why not."""
    from spmd.bench import open_alone, open_world
    from spmd.config.placement import detect

    if backends:
        wanted = names(backends, ("mpi", "gloo"), "backend")
    else:
        wanted = ("mpi", "gloo") if alone or detect(os.environ).is_mpi else ("gloo",)
    try:
        return (open_alone if alone else open_world)(wanted, threads)
    except SpmdError as exc:
        raise click.ClickException(str(exc)) from None
