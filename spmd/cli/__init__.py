"""The ``spmd`` command: one click group, one module per subcommand."""

import importlib

import click

from spmd import __version__


class _LazyGroup(click.Group):
    """A group whose subcommands are imported when used (click's lazy-loading pattern).

    ``spmd run`` then does not import the benchmark, and
    ``python -m spmd.cli.bench`` does not import its own module twice.
    """

    COMMANDS = {"bench": ".bench", "doctor": ".doctor", "info": ".info", "repl": ".repl", "run": ".run",
                "submit": ".submit"}

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self.COMMANDS))

    def get_command(self, ctx, name):
        if name in self.COMMANDS:
            return getattr(importlib.import_module(self.COMMANDS[name], __name__), name)
        return super().get_command(ctx, name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="spmd")
def main():
    """Run one Python script as many cooperating processes."""
