"""What both sides of the fail-fast hub share: ``Reply``, and ``Hub``, their base.

``open_hub(rank, ...)`` (the package's) makes a ``HubServer`` on rank 0 and a
``HubClient`` on the other ranks; both end their process here, once its own
report (if it is writing one) is written (docs/reliability.md, "The hub's protocol").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from spmd.failfast.abort import exit_now
from spmd.failfast.hub.messages import host_name

__all__ = ["Hub", "Reply", "REPORT_WAIT", "ANSWER_WAIT"]

#: Seconds a failing rank waits for the hub's answer; without one it prints in full.
ANSWER_WAIT = 5.0
#: Seconds an ABORT waits for this rank's own report to be written.
REPORT_WAIT = 3.0


class Reply:
    """An answer that one thread waits for and another gives.

    send: called with the value when it is given (a rank's answer goes out
    on its connection); without it, wait() returns the value.
    """

    __slots__ = ("_value", "_given", "_send")

    def __init__(self, send: Callable[[Any], object] | None = None) -> None:
        self._value: Any = None
        self._given = threading.Event()
        self._send = send

    def set(self, value: Any) -> None:
        """Give the answer (again: the last one counts)."""
        self._value = value
        self._given.set()
        if self._send is not None:
            self._send(value)

    def cancel(self) -> None:
        """No answer will come: wake whoever waits (it gets what was given before, or None)."""
        self._given.set()

    def wait(self, timeout: float) -> Any:
        """The answer, or None if none came within timeout seconds."""
        return self._value if self._given.wait(timeout) else None


class Hub:
    """Rank 0's relay of failures and the other ranks' connections to it: one authenticated connection per rank."""

    def __init__(self, rank: int, size: int, share: Callable[[str | None], str], local_only: bool,
                 timeout: float, monitors: Sequence[Any] = (), name: str | None = None, beat: float = 0.0) -> None:
        """share(value) returns rank 0's value on every rank (a broadcast); local_only: every rank on this host;
        timeout: seconds a rank has to connect; monitors: this rank's, for STACKS; name: this rank's host,
        as reports name it; beat: seconds between heartbeats (0: none; docs/reliability.md, "Host faults")."""
        self.rank, self.size = rank, size
        self.monitors = monitors
        self.name = host_name(name)
        self.beat = beat
        self._closing = False  # from now on a closed connection is no death
        self._reporting = threading.Event()  # this rank asked judge(): an ABORT waits for its report
        self._printed = threading.Event()  # ... and it is written
        self._ending = False  # an ABORT is waiting for that
        self._verdict = Reply()  # judge()'s answer: the rank that prints in full

    def judge(self, digest: str, timeout: float = ANSWER_WAIT) -> int | None:
        """This rank failed with an error of this digest: return the rank that prints it in full.

        That is the lowest rank that failed alike within the hub's window,
        this one's if so; None when no answer came in time (print in full).
        Call judged() once the report is written.
        """
        self._reporting.set()
        if not self._ask_verdict(digest):
            return None
        return self._verdict.wait(timeout)

    def judged(self) -> None:
        """This rank's report is written: an ABORT may end it now."""
        self._printed.set()

    def stacks_report(self, timeout: float = 2.0, reason: str = "timeout") -> str | None:
        """Ask every rank where it is; rank 0 prints one report; return its text (None if none came).

        timeout: seconds the hub waits for the ranks' answers.  reason:
        "timeout" (a call timed out here: a report made for an earlier
        timeout in the last few seconds is reused) or "signal".
        """
        wait = max(0.1, float(timeout))
        reply = Reply()
        if not self._ask_where(reason.encode(), wait, reply):
            return None
        return reply.wait(wait + 2.0)

    def ask_stacks(self) -> None:
        """Ask for the stacks report without waiting (SIGUSR2's trigger: rank 0 prints it)."""
        self._ask_where(b"signal", 2.0, None)

    def _ask_where(self, reason: bytes, wait: float, reply: Reply | None) -> bool:
        """Ask the hub for the stacks report (answered into reply, if given); tell whether it was asked."""
        raise NotImplementedError

    def _ask_verdict(self, digest: str) -> bool:
        """Ask the hub which rank prints this digest in full (answered into _verdict); tell whether it was asked."""
        raise NotImplementedError

    def _exit(self, code: int, message: str | None = None, before: Callable[[], None] | None = None) -> None:
        """End this process at once: message said first, then before() called."""
        exit_now(code, message, before)

    def _end(self, code: int, message: str | None = None) -> None:
        """End this process, once its own report (if it is writing one) is written."""
        if not self._reporting.is_set() or self._printed.is_set():
            self._exit(code, message)
            return
        if self._ending:
            return
        self._ending = True

        def later():
            self._printed.wait(REPORT_WAIT)
            self._exit(code, message)

        threading.Thread(target=later, name="spmd-end", daemon=True).start()
