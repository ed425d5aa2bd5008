"""Relaunch a failed local job, like torchrun's --max-restarts: ``spmd run --max-restarts N``.

Each attempt is one whole spmd.launch.supervise.launch, with its own listening
socket and port and, with preload, its own fork server (a kept one, preload_keep,
serves every attempt); every process of an attempt has ended before the next
starts.  Every rank sees SPMD_RESTART_COUNT (0 on the first attempt).  A job that
succeeds, or that a signal to the launcher stopped, is not relaunched; the exit
status is the last attempt's.  The decisions are pure (decide and the messages);
launch_with_restarts runs the loop.  docs/restarts.md.
"""

import os
import sys
from dataclasses import dataclass
from typing import Optional

from spmd.errors import LaunchError
from spmd.launch.supervise import _trap, launch
from spmd.util.words import exit_text, signal_name

__all__ = ["COUNT", "Attempt", "decide", "restarting", "giving_up", "launch_with_restarts"]

#: The variable that tells each rank which attempt it is in: 0, 1, 2 ...
COUNT = "SPMD_RESTART_COUNT"


@dataclass(frozen=True)
class Attempt:
    """How one attempt ended."""

    number: int
    """0 for the first attempt, 1 for the first restart, ... (its SPMD_RESTART_COUNT)."""
    nprocs: int
    """Ranks it ran on."""
    code: int
    """Its exit status, as launch returned it."""
    rank: Optional[int] = None
    """The rank whose failure was reported, or None."""
    returncode: Optional[int] = None
    """That rank's returncode (negative: killed by that signal), or None."""
    stopped: Optional[int] = None
    """The signal that stopped the launcher (the user ended the job), or None."""

    @property
    def cause(self) -> str:
        """Say why it failed: 'rank 1 killed by signal SIGKILL'."""
        if self.stopped is not None:
            return f"{signal_name(self.stopped)} received"
        if self.rank is not None and self.returncode is not None:
            return f"rank {self.rank} {exit_text(self.returncode)}"
        return f"exit status {self.code}"


def decide(attempt: Attempt, max_restarts: int) -> str:
    """Return what follows attempt: 'done' (it succeeded), 'stopped' (the user ended it),
    'restart', or 'give up' (it failed and max_restarts restarts have been made)."""
    if attempt.code == 0:
        return "done"
    if attempt.stopped is not None:
        return "stopped"
    return "restart" if attempt.number < max_restarts else "give up"


def _ranks(n):
    return f"{n} rank" if n == 1 else f"{n} ranks"


def restarting(attempt: Attempt, max_restarts: int, nprocs: int) -> str:
    """The line spmd run prints before relaunching a failed attempt on nprocs ranks."""
    return (f"spmd run: attempt {attempt.number + 1} of {max_restarts + 1} failed ({attempt.cause}); "
            f"restarting on {_ranks(nprocs)} ({COUNT}={attempt.number + 1})\n")


def giving_up(attempt: Attempt) -> str:
    """The line spmd run prints when the last allowed attempt failed too."""
    return (f"spmd run: giving up after {attempt.number + 1} attempts; the last failed "
            f"({attempt.cause}), exit status {attempt.code}\n")


def _say(text):
    sys.stderr.flush()
    sys.stderr.write(text)
    sys.stderr.flush()


def launch_with_restarts(argv, nprocs, *, max_restarts=0, restart_ranks=None, env=None, say=_say, **options):
    """Run launch(argv, nprocs, **options); relaunch the job after a failure up to max_restarts
    times, on restart_ranks ranks (default nprocs); return the last attempt's exit status.

    env: the environment the ranks start from (default os.environ), to which each
    attempt adds SPMD_RESTART_COUNT.  say: writes spmd run's own lines (stderr).
    """
    for name, value, least in (("max_restarts", max_restarts, 0), ("restart_ranks", restart_ranks, 1)):
        if value is None and name == "restart_ranks":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise LaunchError(f"{name} must be an integer >= {least}, got {value!r}")
    base = dict(os.environ if env is None else env)
    stop = []  # a signal between attempts (during one, launch traps it and reports it)
    restore = _trap(lambda signum, frame: stop.append(signum))
    try:
        number, size = 0, nprocs
        while True:
            outcome = {}
            code = launch(argv, size, env=dict(base, **{COUNT: str(number)}), outcome=outcome, **options)
            attempt = Attempt(number, size, code, outcome.get("rank"), outcome.get("returncode"),
                              outcome.get("stopped"))
            verdict = decide(attempt, max_restarts)
            if verdict == "restart" and stop:
                say(f"spmd run: {signal_name(stop[0])} received, stopping\n")
                return 128 + stop[0]
            if verdict != "restart":
                if verdict == "give up" and max_restarts:
                    say(giving_up(attempt))
                return code
            size = nprocs if restart_ranks is None else restart_ranks
            say(restarting(attempt, max_restarts, size))
            number += 1
    finally:
        restore()
