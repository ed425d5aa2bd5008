"""The one-line hints at start (spmd.runtime.hints), the process clock, and the suite's own tier plan."""

import time

import pytest

from spmd.config.settings import Settings
from spmd.runtime import hints
from spmd.util.clock import process_age
from tests.tiers import plan_lines

pytestmark = pytest.mark.unit


def test_more_ranks_than_cpus_is_said_with_the_faster_ways():
    assert hints.oversubscribed(2, 2) is None and hints.oversubscribed(1, 8) is None
    line = hints.oversubscribed(8, 2)
    assert "\n" not in line and line.startswith("spmd: 8 ranks share this host's 2 CPUs")
    assert "spmd run --preload torch -n 8" in line and "-n 2 works as fast" in line
    assert "1 CPU and" in hints.oversubscribed(3, 1)


def test_only_rank_0_says_it(capsys, monkeypatch):
    monkeypatch.setattr(hints, "cpus", lambda: 2)
    hints.at_start(1, 8)
    assert capsys.readouterr().err == ""
    hints.at_start(0, 8)
    assert capsys.readouterr().err.count("ranks share this host") == 1


def test_hints_are_on_unless_turned_off():
    assert Settings.parse({}).hints is True
    assert Settings.parse({"SPMD_HINTS": "0"}).hints is False and Settings.parse({"SPMD_HINTS": "on"}).hints


def test_the_process_age_counts_from_this_process_start():
    import subprocess
    import sys

    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", "from spmd.util.clock import process_age; print(process_age())"],
                         capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - started
    age = float(out.stdout)  # a new process's age: within the time its parent waited for it
    assert 0.0 <= age <= elapsed + 0.02, (age, elapsed)  # 0.02: the clock's 10 ms ticks, twice
    mine = process_age()
    assert mine is not None and mine >= elapsed - 0.02  # this process is older than its child's run


def test_the_tier_plan_says_counts_and_the_last_times_here():
    last = {"unit": {"tests": 100, "seconds": 60.0}, "launcher": {"tests": 10, "seconds": 600.0}}
    lines = plan_lines({"unit": 50, "launcher": 10, "slurm": 3}, last)
    assert "unit" in lines[0] and "50 tests" in lines[0] and "about 30 s" in lines[0], lines
    assert "last run here: 10 tests in 10.0 min, so about 10.0 min" in lines[1], lines
    assert "no earlier run on this machine" in lines[2] and len(lines) == 3  # no total when one is unknown
    lines = plan_lines({"unit": 100}, last)
    assert lines[-1].startswith("  about 60 s in all") and "bin/test -m unit" in lines[-1]
