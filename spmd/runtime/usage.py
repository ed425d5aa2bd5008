"""Usage errors said once per job, not once per rank.

Every rank parses the same command line, so every rank finds the same
mistake: printed by each, one typo under ``mpirun -n 4`` was twelve lines.
:func:`run_command` runs a click command on every rank; click's usage
errors and ``--help`` are printed by the rank that speaks for the job
(rank 0; every rank when the launcher's variables cannot tell which rank
this is).  The speaking rank exits with click's status (2 for a usage
error), the others with 0: torchrun and mpirun end the job at the first
rank that fails, and a quiet rank that failed first had its launcher kill
the speaking rank before it said why.  The job's status is the speaking
rank's.  :func:`say_once` does the same for a message of the script's own.

A rank that ends this way raises :class:`UsageExit`, a SystemExit that
``python -m spmd`` passes on as it is: no failure report, no abort.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, NoReturn, Optional, Sequence

__all__ = ["UsageExit", "speaks", "say_once", "run_command"]


class UsageExit(SystemExit):
    """This rank ends with a usage error's status; the speaking rank has said why."""


def speaks(per_host: bool = False) -> bool:
    """Whether this rank says what every rank finds alike: rank 0 of the job (with per_host: the first
    rank of its host, for what depends on the host's files); True when this rank's place is unknown."""
    from spmd.runtime.start import initialized

    if initialized() and not per_host:
        from spmd.runtime.proxy import comm

        return comm.rank == 0
    try:
        from spmd.config.placement import detect

        placement = detect(os.environ)
    except Exception:  # noqa: BLE001 - unknown: better said by each than by none
        return True
    return (placement.local_rank if per_host else placement.rank) == 0


def say_once(message: str, code: int = 2, per_host: bool = False) -> NoReturn:
    """Print message on stderr from the speaking rank (see speaks), which ends with code; the others end with 0."""
    speaking = speaks(per_host)
    if speaking:
        print(message, file=sys.stderr, flush=True)
    raise _ending(code, not speaking)


def _ending(code: int, quiet: bool) -> UsageExit:
    """The exit of a rank that ends with a usage error: code on the speaking rank, 0 on a quiet one.

    A quiet rank that exited with the error's status before the speaking rank
    had printed it was the job's first failure: torchrun (and mpirun) then
    ended the speaking rank, and nobody said why.
    """
    return UsageExit(0 if quiet else code)


@contextlib.contextmanager
def _silenced(quiet: bool):
    if not quiet:
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        yield


def run_command(command: Any, args: Optional[Sequence[str]] = None, prog_name: Optional[str] = None,
                **extra: Any) -> Any:
    """Run the click command on every rank of the job (``if __name__ == "__main__": run_command(main)``).

    args default to sys.argv[1:], prog_name to the script's name; extra go
    to click's make_context.  A bad option or argument, and ``--help``,
    are printed once, by the speaking rank, which exits with click's
    status (2 for a usage error, 0 after --help); the others exit 0.  A
    ``click.UsageError`` the command raises itself (a wrong combination
    of options) is a fact about the command line too: said once, status 2.
    Any other ``click.ClickException`` is shown by each rank that raises
    it (it may hold on some ranks only), which then exits with its status.
    Returns what the command returns.
    """
    import click

    quiet = not speaks()
    argv = list(sys.argv[1:] if args is None else args)
    name = prog_name or os.path.basename(sys.argv[0] or "") or None
    try:
        with _silenced(quiet):
            ctx = command.make_context(name, argv, **extra)
    except click.exceptions.Exit as exc:  # --help, --version: printed by the speaking rank
        raise _ending(exc.exit_code, quiet) from None
    except click.ClickException as exc:
        if not quiet:
            exc.show()
        raise _ending(exc.exit_code, quiet) from None
    except click.Abort:
        if not quiet:
            click.echo("Aborted!", err=True)
        raise _ending(1, quiet) from None
    try:
        with ctx:
            return command.invoke(ctx)
    except click.exceptions.Exit as exc:
        raise SystemExit(exc.exit_code) from None
    except click.UsageError as exc:
        if not quiet:
            exc.show()
        raise _ending(exc.exit_code, quiet) from None
    except click.ClickException as exc:
        exc.show()
        raise SystemExit(exc.exit_code) from None
