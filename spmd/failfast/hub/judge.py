"""The fail-fast hub's decisions, without sockets, threads or clocks of its own.

``Verdicts``: which rank prints each error in full (the lowest that failed
with it within WINDOW of the first failure).  ``Gathering``: the report of
where every rank is, one at a time, complete when every rank answered or
its wait is over, reused by the timeouts that follow it.  ``Silence``: who
has not been heard from for MISSES heartbeats.  ``death`` and ``silence``:
what rank 0 says of ranks that vanished or fell silent, by host.  Both
sides feed them what was said and when (docs/reliability.md, "One report
per job" and "Host faults").
"""

from __future__ import annotations

from typing import Any

from collections.abc import Iterable, Mapping

from spmd.failfast import report
from spmd.failfast.hub.messages import MAX_STACK
from spmd.util.words import ranks_text

__all__ = ["Verdicts", "Gathering", "Silence", "death", "silence", "WINDOW", "REUSE", "MISSES"]

#: Seconds the hub collects failures after the first one before it says which rank prints each in full.
WINDOW = 0.4
#: Seconds a report of stacks asked for at a timeout serves the timeouts that follow it.
REUSE = 10.0
#: Heartbeats missed in a row after which a side is declared silent (SPMD_HEARTBEAT seconds apart).
MISSES = 5


def by_host(ranks: Iterable[int], hosts: Mapping[int, str]) -> list[tuple[str | None, list[int]]]:
    """ranks grouped by their host (None: not known), in order of each host's lowest rank."""
    groups: dict[str | None, list[int]] = {}
    for rank in sorted(ranks):
        groups.setdefault(hosts.get(rank), []).append(rank)
    return list(groups.items())


def _on_hosts(ranks: Iterable[int], hosts: Mapping[int, str]) -> str:
    """'h2 (ranks 2, 3)', 'h2 (rank 2) and h3 (rank 4)', 'rank 2' where the host is not known."""
    parts = [f"{host} ({ranks_text(group)})" if host else ranks_text(group) for host, group in by_host(ranks, hosts)]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def death(rank: int | Iterable[int], size: int, hosts: Mapping[int, str] | None = None, home: str | None = None) -> str:
    """What ends the job when these ranks' connections closed without a word.

    hosts: each rank's host, where known; a host other than home (rank 0's) is named.
    """
    ranks = sorted([rank] if isinstance(rank, int) else rank)
    hosts = hosts or {}
    away = {hosts[r] for r in ranks if r in hosts} - {home, None}
    if not away:
        who = f"{ranks_text(ranks)} of {size}"
    elif len(ranks) == 1 or len({hosts.get(r) for r in ranks}) == 1:
        who = f"{ranks_text(ranks)} of {size} on {hosts[ranks[0]]}"
    else:
        who = f"{_on_hosts(ranks, hosts)} of {size}"
    return f"{who} died without reporting an error (killed by a signal, or exited without finalize)"


def silence(silent: Mapping[int, float], hosts: Mapping[int, str] | None = None, home: str | None = None,
            size: int | None = None) -> str:
    """What ends the job when these ranks (rank -> seconds since last heard) sent no heartbeat.

    home and size (rank 0's host, the world's size), where given: when every rank of two or more other
    hosts fell silent at once, the likelier cause is home's own link, and the words say so.
    """
    hosts = hosts or {}
    seconds = max(silent.values())
    said = (f"no word from {_on_hosts(silent, hosts)} for {seconds:.0f} s (no heartbeat: "
            "a host down, cut off or frozen, or a process stopped)")
    away = {r for r in range(size or 0) if hosts.get(r) not in (home, None)}
    if home and away and away <= set(silent) and len({hosts[r] for r in away}) > 1:
        said += f": every other host fell silent at once, so {home} itself (rank 0's host) may be cut off"
    return said


class Silence:
    """Who has not been heard from for MISSES heartbeats: one side's judge of the other side.

    Time this side itself was away (its thread not run for longer than an
    interval: the process stopped, or starved) does not count against the others.
    """

    def __init__(self, interval: float, misses: int = MISSES) -> None:
        self.interval, self.limit = interval, interval * misses
        self._heard: dict[int, float] = {}  # rank -> when it was last heard from
        self._looked: float | None = None  # when this side last looked

    def heard(self, rank: int, now: float) -> None:
        """rank said something at now (a heartbeat or anything else)."""
        self._heard[rank] = now

    def forget(self, rank: int) -> None:
        """rank left (it said BYE, or its connection closed): it is no longer expected to speak."""
        self._heard.pop(rank, None)

    def deadline(self) -> float | None:
        """When the first rank heard from becomes silent, if none speaks meanwhile."""
        return min(self._heard.values()) + self.limit if self._heard else None

    def silent(self, now: float) -> dict[int, float]:
        """{rank: seconds since heard} of every rank that missed a beat, once one has missed MISSES in a row;
        else {}."""
        if self._looked is not None and now - self._looked > self.interval:  # this side was away
            gap = now - self._looked - self.interval
            self._heard = {rank: when + gap for rank, when in self._heard.items()}
        self._looked = now
        if not any(now - when >= self.limit for when in self._heard.values()):
            return {}
        return {rank: now - when for rank, when in self._heard.items() if now - when > 1.5 * self.interval}


class Verdicts:
    """Who prints each error in full.  A waiter is whatever the caller answers (the judge only returns it)."""

    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self._end: float | None = None  # the window's end, set by the first failure
        self._held: dict[int, tuple[str, Any]] = {}  # rank -> (digest, waiter), until the window's end
        self._leads: dict[str, int] = {}  # digest -> the rank that prints it in full

    def failed(self, rank: int, digest: str, waiter: Any, now: float) -> list[tuple[Any, int]]:
        """rank failed with this digest at now: return the answers due now, [(waiter, lead)] or []."""
        if self._end is None:
            self._end = now + self.window
        if now < self._end:
            self._held[rank] = (digest, waiter)
            return []
        return [(waiter, self._leads.setdefault(digest, rank))]

    def deadline(self) -> float | None:
        """When the failures held are due, if any are."""
        return self._end if self._held else None

    def due(self, now: float) -> list[tuple[Any, int]]:
        """The answers to the failures held, once the window has passed: the lowest rank's first."""
        if not self._held or now < self._end:
            return []
        held, self._held = self._held, {}
        return [(held[rank][1], self._leads.setdefault(held[rank][0], rank)) for rank in sorted(held)]


class Gathering:
    """The report of where every rank is: one in progress at most, every asker answered with it."""

    def __init__(self, size: int, reuse: float = REUSE) -> None:
        self.size, self.reuse = size, reuse
        self._asked = ""  # what the report's head says asked for it
        self._wait = 0.0
        self._deadline: float | None = None  # None: no report in progress
        self._waiters: list[Any] = []
        self._got: dict[int, dict] = {}  # rank -> its summary (report.where)
        self._last: tuple[float, str] | None = None  # (when, text) of the last report

    @property
    def deadline(self) -> float | None:
        """When the report in progress ends whoever has not answered, if one is."""
        return self._deadline

    def reusable(self, timeout: bool, now: float) -> str | None:
        """The last report, if an ask for this reason may have it now: one hang, one report (the first timeout's)."""
        if self._deadline is None and timeout and self._last and now - self._last[0] < self.reuse:
            return self._last[1]
        return None

    def ask(self, waiter: Any, asked: str, wait: float, now: float, own: Any) -> bool:
        """Add waiter to the report in progress, or start one (own(): rank 0's summary); tell whether it started."""
        started = self._deadline is None
        if started:
            self._asked, self._wait, self._deadline = asked, wait, now + wait
            self._waiters, self._got = [], {0: own()}
        self._waiters.append(waiter)
        return started

    def answered(self, rank: int, summary: Any) -> None:
        """rank's answer (a decoded summary: only a dict of strings is kept, each value cut to MAX_STACK)."""
        if self._deadline is not None and isinstance(summary, dict):
            self._got[rank] = {k: str(v)[:MAX_STACK] if v is not None else None
                               for k, v in summary.items() if isinstance(k, str)}

    def complete(self) -> bool:
        """Every rank has answered the report in progress."""
        return self._deadline is not None and len(self._got) >= self.size

    def overdue(self, now: float) -> bool:
        """The report in progress has waited its time."""
        return self._deadline is not None and now >= self._deadline

    def end(self, now: float) -> tuple[str, list[Any]]:
        """End the report in progress: return its text and the waiters to give it to."""
        text = report.stacks_text(self._got, self.size, self._asked, self._wait)
        waiters, self._waiters, self._got, self._deadline = self._waiters, [], {}, None
        self._last = (now, text)
        return text, waiters
