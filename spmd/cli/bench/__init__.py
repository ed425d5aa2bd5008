"""``spmd bench``: measure your own cluster, one subcommand per measurement.

``collectives`` and ``memory`` run under a launcher (``mpirun -n 2 spmd bench
collectives``), or start ``mpirun -n N`` themselves with ``--launch N``;
``startup``, ``preload``, ``pipeline`` and ``train`` make separate launches of
their own.  Comparisons with tools a user may not have (Dask, ipyparallel,
pytest_parallel) live outside the package, in the repository's benchmarks/.
"""

import click

from spmd.cli.bench.collectives import collectives, memory
from spmd.cli.bench.launches import pipeline, preload, startup, train

__all__ = ["bench", "MOVED"]

#: The flat form's mode flags (``spmd bench --startup``, ...): the command that makes each measurement.
MOVED = {"--startup": "spmd bench startup", "--preload": "spmd bench preload MODULES",
         "--pipeline": "spmd bench pipeline", "--train": "spmd bench train", "--memory": "spmd bench memory",
         "--pytest": "python -m benchmarks.pytest_runners (from the repository's root)"}


class _Bench(click.Group):
    """spmd bench's group: an option before the subcommand is the old flat form, answered with the new one."""

    def parse_args(self, ctx, args):
        first = args[0] if args else ""
        if first.startswith("-") and first not in self.get_help_option_names(ctx):
            flag = first.partition("=")[0]
            hint = (f"{flag} is now {MOVED[flag]!r}" if flag in MOVED
                    else f"did you mean 'spmd bench collectives {' '.join(args)}'?")
            raise click.UsageError(f"spmd bench takes the measurement first, then its options: {hint} "
                                   f"(the measurements: {', '.join(self.list_commands(ctx))})", ctx)
        return super().parse_args(ctx, args)


@click.group(cls=_Bench, commands=[collectives, memory, startup, preload, pipeline, train],
             context_settings={"help_option_names": ["-h", "--help"]})
def bench():
    """Measure spmd on this machine or cluster: one subcommand per measurement.

    Every measurement interleaves what it compares and reports medians;
    docs/bench.md says how each one measures.  Example:

        mpirun -n 2 spmd bench collectives --max-size 64M --json out.json
    """
