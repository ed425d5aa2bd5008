"""A suite that tells where it is: the tiers it will run, how long each took here last time, each tier's start.

Registered by conftest.py.  After collection the tests run tier by tier
(unit, launcher, slurm; the order within a tier is kept), the plan is
printed with each tier's test count and its last measured time on this
machine, and a line marks the start of each tier.  At the end of a run of
the default test paths without -k, each tier that ran to its end has its
wall time written to TIMES (kept out of git), so the next plan says how
long to expect.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

TIMES = Path(os.environ.get("SPMD_TEST_TIMES", Path(__file__).resolve().parents[1] / ".test-times.json"))


def minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def load(path: Path = TIMES) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def plan_lines(counts: dict[str, int], last: dict) -> list[str]:
    """The plan: one line per tier with its tests and its last time here, and the total to expect."""
    lines, expected, known = [], 0.0, True
    for tier, count in counts.items():
        seen = last.get(tier)
        if seen and seen.get("tests"):
            guess = seen["seconds"] * count / seen["tests"]
            expected += guess
            when = f"last run here: {seen['tests']} tests in {minutes(seen['seconds'])}, so about {minutes(guess)}"
        else:
            known = False
            when = "no earlier run on this machine"
        lines.append(f"  {tier:<9}{count:>6} tests   {when}")
    if known and counts:
        lines.append(f"  about {minutes(expected)} in all; `bin/test -m unit` alone is the quick check")
    return lines


class TierClock:
    """Orders the tests by tier, prints the plan and each tier's start, and records each tier's time."""

    def __init__(self, config: pytest.Config, tiers: tuple[str, ...]) -> None:
        self.config, self.tiers = config, tiers
        self.counts: dict[str, int] = {}
        self.first: dict[str, str] = {}  # tier -> nodeid of its first test
        self.started: dict[str, float] = {}  # tier -> when its first test started (monotonic)
        self.seconds: dict[str, float] = {}  # tier -> its wall time, once the next tier or the end came
        self.done: dict[str, int] = {}
        self.current: str | None = None
        # Only a run of whole tiers is a measure for the next plan: the default test paths, no -k.
        self.whole = config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.keyword

    def tier(self, item: pytest.Item) -> str:
        return next((m.name for m in item.iter_markers() if m.name in self.tiers), "")

    @pytest.hookimpl(trylast=True)  # after -m and -k deselected theirs
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        rank = {t: i for i, t in enumerate(self.tiers)}
        items.sort(key=lambda item: rank.get(self.tier(item), len(rank)))

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        for item in session.items:
            tier = self.tier(item)
            self.counts[tier] = self.counts.get(tier, 0) + 1
            self.first.setdefault(tier, item.nodeid)
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None and self.counts and not self.config.option.collectonly:
            reporter.write_line("tiers to run (docs/testing.md):")
            for line in plan_lines(self.counts, load()):
                reporter.write_line(line)

    @pytest.hookimpl(tryfirst=True)  # the tier's line before the reporter names the file
    def pytest_runtest_logstart(self, nodeid: str, location: tuple) -> None:
        for tier, first in self.first.items():
            if first == nodeid:
                self._close()
                self.current, self.started[tier] = tier, time.monotonic()
                reporter = self.config.pluginmanager.get_plugin("terminalreporter")
                if reporter is not None:
                    reporter.ensure_newline()
                    reporter.write_sep("-", f"tier {tier}: {self.counts[tier]} tests, started {time.strftime('%H:%M:%S')}")

    def pytest_runtest_logfinish(self, nodeid: str, location: tuple) -> None:
        if self.current is not None:
            self.done[self.current] = self.done.get(self.current, 0) + 1

    def _close(self) -> None:
        if self.current is not None:
            self.seconds[self.current] = time.monotonic() - self.started[self.current]

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self._close()
        self.current = None
        whole = {t: {"tests": n, "seconds": round(self.seconds[t], 1)} for t, n in self.counts.items()
                 if t in self.seconds and self.done.get(t) == n}
        if whole and self.whole:
            try:
                TIMES.write_text(json.dumps({**load(), **whole}, indent=1, sort_keys=True) + "\n")
            except OSError:
                pass  # a read-only checkout: the next plan says less
