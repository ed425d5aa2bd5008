"""``spmd run``: start N ranks of one script on this machine, no MPI needed."""

import os
import sys

import click

from spmd.runtime.backends import BACKENDS
from spmd.config.settings import parse_max_restarts
from spmd.errors import LaunchError, RendezvousError, SettingsError
from spmd.launch.restarts import launch_with_restarts
from spmd.launch.forkserver.client import parse_modules

__all__ = ["run"]


@click.command(context_settings={
    "allow_interspersed_args": False,
    "help_option_names": ["-h", "--help"],
})
@click.option("-n", "--nprocs", required=True, type=click.IntRange(min=1),
              help="Number of ranks to start.")
@click.option("--backend", type=click.Choice(BACKENDS),
              help="Communication backend (sets SPMD_BACKEND).")
@click.option("--prefix/--no-prefix", default=None,
              help="Prefix each output line with its rank "
                   "[default: on when NPROCS > 1].")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True),
              metavar="SECONDS",
              help="Timeout of collective operations (sets SPMD_TIMEOUT).")
@click.option("--master-addr", default="127.0.0.1", show_default=True,
              metavar="ADDR", help="Address rank 0 listens on.")
@click.option("--preload", metavar="MODULES",
              help="Import MODULES (comma-separated, e.g. torch,numpy) once in a fork "
                   "server and fork every rank from it, so that no rank imports them "
                   "itself (docs/preload.md).")
@click.option("--preload-keep", type=click.FloatRange(min=0), default=0, envvar="SPMD_PRELOAD_KEEP",
              metavar="SECONDS",
              help="With --preload: fork the ranks from a server kept for later launches "
                   "(the same modules, environment and directory), which skip the imports; "
                   "it exits after SECONDS with no launch [env SPMD_PRELOAD_KEEP; default: 0, "
                   "a server per launch].")
@click.option("--max-restarts", metavar="N",
              help="Relaunch the whole job after a failure, up to N times, each attempt with a "
                   "fresh rendezvous and SPMD_RESTART_COUNT=0, 1, 2 ... in every rank's environment; "
                   "a job the user stopped is not relaunched (docs/restarts.md) "
                   "[env SPMD_MAX_RESTARTS; default: 0].")
@click.option("--restart-ranks", type=click.IntRange(min=1), metavar="M",
              help="Run the relaunched attempts on M ranks [default: NPROCS].")
@click.option("-m", "module", is_flag=True,
              help="SCRIPT is a module name, run like python -m.")
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def run(ctx, nprocs, backend, prefix, timeout, master_addr, preload, preload_keep, max_restarts,
        restart_ranks, module, script, args):
    """Run SCRIPT as NPROCS cooperating ranks on this machine.

    \b
        spmd run -n 4 train.py --epochs 3
        spmd run -n 2 -m mypkg.main

    Each rank runs `python -m spmd SCRIPT ARGS...` with SPMD_RANK,
    SPMD_SIZE, MASTER_ADDR and MASTER_PORT set. If a rank fails, the
    others are stopped and its exit code is returned; with --max-restarts N
    the job is relaunched up to N times first.

    With --preload, one process imports the modules and every rank is
    forked from it, with the same environment, output and supervision;
    with --preload-keep that process serves later launches too.
    """
    if module:
        argv = ["-m", script, *args]
    elif os.path.exists(script):
        argv = [script, *args]
    else:
        raise click.BadParameter(f"no such file: {script!r}",
                                 param_hint="'SCRIPT'")
    if preload is not None:
        try:
            preload = parse_modules(preload)
        except LaunchError as e:
            raise click.BadParameter(str(e), param_hint="'--preload'") from None
    elif preload_keep and ctx.get_parameter_source("preload_keep") is click.core.ParameterSource.COMMANDLINE:
        raise click.BadParameter("keeps the fork server of --preload: give --preload MODULES too",
                                 param_hint="'--preload-keep'")
    else:
        preload_keep = 0  # SPMD_PRELOAD_KEEP applies to --preload launches only
    try:
        max_restarts = parse_max_restarts(os.environ, max_restarts)
    except SettingsError as e:
        raise click.UsageError(str(e)) from None
    if restart_ranks is not None and not max_restarts:
        raise click.BadParameter("sets the size of relaunched attempts: give --max-restarts N "
                                 "(or SPMD_MAX_RESTARTS) too", param_hint="'--restart-ranks'")
    try:
        code = launch_with_restarts(argv, nprocs, max_restarts=max_restarts, restart_ranks=restart_ranks,
                                    backend=backend, prefix=prefix, timeout=timeout,
                                    master_addr=master_addr, preload=preload, preload_keep=preload_keep)
    except (LaunchError, RendezvousError) as e:
        raise click.ClickException(str(e)) from None
    sys.exit(code)
