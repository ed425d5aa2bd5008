"""The ``spmd`` command: one click group, one module per subcommand."""

import click

from .. import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="spmd")
def main():
    """Run one Python script as many cooperating processes."""


def _register():
    from .bench import bench
    from .info import info
    from .run import run
    from .submit import submit

    main.add_command(bench)
    main.add_command(info)
    main.add_command(run)
    main.add_command(submit)


_register()
