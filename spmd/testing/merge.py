"""pytest's one report of a phase of a multi-rank test, made from its ranks' reports.

A phase failed when any rank failed it or ended during it (died, was
stopped); the report shows each distinct failure once with the ranks that
failed alike ("ranks 1, 3"), in pytest's own words (its rewritten
assertion, its traceback), then how each rank that did not finish ended,
the passing ranks, and where every rank was when the server stopped them.
Each rank's captured output is a section of its own ("Captured stdout
call (rank 1)"), identical sections of several ranks shown once.
"""

from __future__ import annotations

import io
from typing import Any

from _pytest._code.code import ReprFileLocation
from _pytest._io import TerminalWriter
from _pytest.reports import TestReport

from spmd.failfast.report import normalise
from spmd.util.words import ranks_text

__all__ = ["Merged", "merge", "synthetic"]


class Merged:
    """The longrepr of a failed phase: each distinct failure once, then what else happened."""

    def __init__(self, size: int, groups: list[tuple[list[int], Any]], endings: dict[int, str],
                 passed: list[int], why: str | None, stacks: str | None, where: tuple[str, int]) -> None:
        self.size, self.groups, self.endings = size, groups, endings
        self.passed, self.why, self.stacks = passed, why, stacks
        self.reprcrash = self._crash(where)

    def _deaths(self) -> list[tuple[int, str]]:
        return [(r, t) for r, t in sorted(self.endings.items()) if not t.startswith("was stopped")]

    def _crash(self, where: tuple[str, int]) -> ReprFileLocation:
        deaths = self._deaths()
        if deaths:  # a rank that died is the cause; its peers' errors are the consequence
            rank, text = deaths[0]
            return ReprFileLocation(where[0], where[1], f"rank {rank} {text.splitlines()[0]}")
        if self.groups:
            ranks, longrepr = self.groups[0]
            crash = getattr(longrepr, "reprcrash", None)
            if crash is not None:
                return ReprFileLocation(crash.path, crash.lineno, f"[{ranks_text(ranks)}] {crash.message}")
            return ReprFileLocation(where[0], where[1], f"[{ranks_text(ranks)}] {str(longrepr).splitlines()[-1:]}")
        rank, text = sorted(self.endings.items())[0]
        return ReprFileLocation(where[0], where[1], f"rank {rank} {text.splitlines()[0]}")

    def toterminal(self, tw: TerminalWriter) -> None:
        for rank, text in self._deaths():
            tw.line(f"rank {rank} of {self.size} {text}", red=True, bold=True)
        for ranks, longrepr in self.groups:
            tw.sep("-", f"{ranks_text(ranks)} of {self.size}", red=True, bold=True)
            if hasattr(longrepr, "toterminal"):
                longrepr.toterminal(tw)
            else:
                tw.line(str(longrepr))
        if self.passed or len(self._deaths()) < len(self.endings):
            tw.sep("-", f"the other ranks of {self.size}", bold=True)
        for rank, text in sorted(self.endings.items()):
            if text.startswith("was stopped"):
                tw.line(f"rank {rank} {text}", red=True)
        if self.passed:
            tw.line(f"{ranks_text(self.passed)} passed")
        if self.stacks:
            tw.line(self.stacks.rstrip("\n"))

    def __str__(self) -> str:
        out = io.StringIO()
        tw = TerminalWriter(out)
        tw.hasmarkup = False
        self.toterminal(tw)
        return out.getvalue()


def _sections(per_rank: dict[int, Any]) -> list[tuple[str, str]]:
    """Each rank's captured sections, retitled with its rank; identical ones once with every rank."""
    seen: dict[tuple[str, str], list[int]] = {}
    for rank in sorted(per_rank):
        for title, content in per_rank[rank].sections:
            seen.setdefault((title, content), []).append(rank)
    return [(f"{title} ({ranks_text(ranks)})", content) for (title, content), ranks in seen.items()]


def synthetic(item: Any, when: str, outcome: str, longrepr: Any = None) -> TestReport:
    """A report of a phase no rank made (a test that never started, or was skipped here)."""
    return TestReport(item.nodeid, item.location, {k: 1 for k in item.keywords}, outcome, longrepr, when)


def merge(item: Any, when: str, size: int, per_rank: dict[int, Any], endings: dict[int, str],
          why: str | None = None, stacks: str | None = None) -> TestReport:
    """Return the phase's one report from per_rank {rank: report} and endings {rank: how it ended in it}."""
    failed = sorted(r for r, rep in per_rank.items() if rep.failed)
    reps = list(per_rank.values())
    duration = max((rep.duration for rep in reps), default=0.0)
    sections = _sections(per_rank)
    if not failed and not endings and reps:
        base = per_rank[min(per_rank)]
        if not all(rep.outcome == base.outcome and getattr(rep, "wasxfail", None) == getattr(base, "wasxfail", None)
                   for rep in reps):  # passed on some ranks, skipped on others: it passed
            base = next((rep for rep in reps if rep.passed), base)
        base.sections, base.duration = sections, duration
        return base
    groups: dict[str, tuple[list[int], Any]] = {}
    for r in failed:
        longrepr = per_rank[r].longrepr
        crash = getattr(longrepr, "reprcrash", None)
        key = normalise(f"{crash.path}:{crash.lineno}: {crash.message}" if crash is not None else str(longrepr))
        groups.setdefault(key, ([], longrepr))[0].append(r)
    passed = sorted(r for r, rep in per_rank.items() if rep.passed and r not in endings)
    path, lineno = item.location[0], (item.location[1] or 0) + 1
    longrepr = Merged(size, list(groups.values()), endings, passed, why, stacks, (path, lineno))
    props = [p for rep in reps for p in rep.user_properties]
    return TestReport(item.nodeid, item.location, {k: 1 for k in item.keywords}, "failed", longrepr, when,
                      sections=sections, duration=duration, user_properties=props)
