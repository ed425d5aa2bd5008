"""``spmd repl``: a prompt whose every statement runs on N ranks (spmd.interactive.console)."""

import sys

import click

__all__ = ["repl"]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-n", "--nprocs", required=True, type=click.IntRange(min=1), help="Number of ranks to start.")
@click.option("--backend", type=click.Choice(["gloo", "mpi"]), default="gloo", show_default=True,
              help="Communication backend of the ranks: gloo (forked from one process that imported "
                   "torch, restarted in a tenth of a second) or mpi (started by mpirun).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="Report where every rank is and interrupt a statement that runs longer "
                   "(%timeout changes it) [default: no limit; Ctrl-C interrupts].")
@click.option("--preload", metavar="MODULES",
              help="Import MODULES (comma-separated) once for every rank, before the ranks start "
                   "[torch and numpy always are].")
def repl(nprocs, backend, timeout, preload):
    """Start NPROCS ranks and a prompt; each statement runs on every rank.

    \b
        spmd repl -n 4
        >>> x = comm.all_reduce(np.ones(2) * comm.rank)

    Output comes back merged, each distinct line once with its ranks
    ([0-3] ...). %help lists the commands (%on, %pull, %push, %timeout,
    %restart); docs/interactive.md is the reference.
    """
    from spmd.errors import LaunchError
    from spmd.interactive.console import main
    from spmd.launch.forkserver.client import parse_modules

    try:
        modules = parse_modules(preload) if preload else None
    except LaunchError as e:
        raise click.BadParameter(str(e), param_hint="'--preload'") from None
    sys.exit(main(nprocs, backend=backend, timeout=timeout, preload=modules))
