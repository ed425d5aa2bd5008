"""Under a launcher (``mpirun -n 8 pytest``): the world's ranks run the tests, several at a time.

Every rank collects the same tests; spmd.testing.schedule packs them into
waves of tests on disjoint ranks.  For each wave the world splits into one
communicator per test (the ``comm`` fixture of its ranks), each rank runs
its test in this process as pytest would, the communicators are freed, and
rank 0 gathers the wave's reports and alone writes pytest's report (its
terminal, junit file and cache; the other ranks are pytest's "workers").
Unmarked tests run once, on one rank each.  A test that needs more ranks
than the world has, or another backend than the world's, is skipped,
saying so.  What a launcher does not allow is said in
docs/testing-your-code.md: a rank that dies ends the job, and on the mpi
backend so does a collective past its timeout.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from spmd.testing.frames import hide_spmd_frames
from spmd.testing.marks import COMM, size_of, spec_of
from spmd.testing.merge import merge, synthetic
from spmd.testing.schedule import Slot, waves
from spmd.testing.tmp import share

__all__ = ["WorldRanks"]


def _silence(config: Any) -> None:
    """A rank other than 0 writes nothing of pytest's own: rank 0 reports for every rank."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        from _pytest.config import create_terminal_writer

        reporter._tw = create_terminal_writer(config, open(os.devnull, "w"))


class WorldRanks:
    """The plugin under a launcher: this rank's part of every wave, and rank 0's report."""

    def __init__(self, config: Any, timeout: float) -> None:
        from spmd.config.placement import detect

        placement = detect(os.environ)
        self.rank, self.size, self.timeout = placement.rank, placement.size, timeout
        if self.rank != 0:  # pytest's own convention: a worker writes no junit file, cache or stepwise state
            config.workerinput = {"workerid": f"spmd-rank{self.rank}"}
            config.workeroutput = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: Any) -> None:
        if self.rank != 0:
            _silence(session.config)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: Any) -> bool:
        if session.testsfailed and not session.config.option.continue_on_collection_errors:
            raise session.Interrupted(f"{session.testsfailed} error(s) during collection")
        if session.config.option.collectonly:
            return True
        import spmd

        items = session.items
        specs = [spec_of(item) for item in items]
        timeouts = [s.timeout for s in specs if s is not None and s.timeout]
        # (a test module's `comm.rank` at import may have started the world already: it is kept)
        comm = spmd.init() if spmd.initialized() else spmd.init(timeout=max([self.timeout, *timeouts]))
        self._agree(comm, items)
        self.base = self._basetemp(comm, session.config)
        sizes, skipped = self._sizes(comm, items, specs)
        plan = waves([n or 1 for n in sizes], comm.size) if items else []
        mine = [slot.index for wave in plan for slot in wave if comm.rank in slot.ranks and sizes[slot.index] != 0]
        following = dict(zip(mine, mine[1:] + [None]))
        if comm.rank == 0:
            for i, why in skipped.items():
                self._log(items[i], [synthetic(items[i], "setup", "skipped", _skip(items[i], why)),
                                     synthetic(items[i], "teardown", "passed")])
        for wave in plan:
            wave = [slot for slot in wave if sizes[slot.index] != 0]
            if self._run_wave(session, comm, wave, specs, following):
                break
        return True

    def _agree(self, comm: Any, items: list[Any]) -> None:
        ids = "\n".join(item.nodeid for item in items).encode()
        seen = comm.all_gather_object((len(items), hashlib.sha1(ids).hexdigest()))
        if len(set(seen)) > 1:
            counts = ", ".join(f"rank {r}: {n}" for r, (n, _) in enumerate(seen))
            raise pytest.UsageError(
                f"spmd: the ranks collected different tests ({counts} tests): run the same pytest "
                "command, in the same directory, on every rank")

    @staticmethod
    def _basetemp(comm: Any, config: Any) -> Path:
        """Rank 0's basetemp, under which each rank gets its own and each test one for its ranks.

        Ranks that each chose a numbered basetemp of their own would clean
        up each other's; on several hosts without a shared file system a
        test's directory is shared by its ranks of one host only.
        """
        factory = config._tmp_path_factory
        base = Path(comm.broadcast_object(str(factory.getbasetemp()) if comm.rank == 0 else None, 0))
        if comm.rank != 0:
            mine = base / f"rank{comm.rank}"
            mine.mkdir(mode=0o700, parents=True, exist_ok=True)
            factory._basetemp = mine
        return base

    def _sizes(self, comm: Any, items: list[Any], specs: list[Any]) -> tuple[list[int], dict[int, str]]:
        """Each test's ranks (1 unmarked, 0 skipped) and why each skipped test is."""
        sizes, skipped = [], {}
        for i, (item, spec) in enumerate(zip(items, specs)):
            if spec is None:
                sizes.append(1)
                continue
            n = size_of(item, spec)
            if n > comm.size:
                skipped[i] = f"needs {n} ranks; the world has {comm.size} (launch at least {n})"
            elif spec.backend not in (None, "auto", comm.backend):
                skipped[i] = f"backend {spec.backend!r} asked; the world runs {comm.backend!r}"
            sizes.append(0 if i in skipped else n)
        return sizes, skipped

    def _run_wave(self, session: Any, comm: Any, wave: list[Slot], specs: list[Any],
                  following: dict[int, int | None]) -> bool:
        """Run this rank's test of the wave; rank 0 logs the wave. Return whether the session stops."""
        config = session.config
        slot = next((s for s in wave if comm.rank in s.ranks), None)
        marked = slot is not None and specs[slot.index] is not None
        color = wave.index(slot) if marked else None
        sub = comm.split(color, slot.ranks.index(comm.rank) if marked else 0)
        reports: list[Any] = []
        if slot is not None:
            item = session.items[slot.index]
            nxt = following.get(slot.index)
            config.stash[COMM] = sub
            undo = share(config, self.base / f"t{slot.index}") if marked else (lambda: None)
            if marked:
                hide_spmd_frames(item)
            try:
                from _pytest.runner import runtestprotocol

                reports = runtestprotocol(item, log=False, nextitem=None if nxt is None else session.items[nxt])
            finally:
                del config.stash[COMM]
                undo()
        if sub is not None:
            sub.free()
        serial = [config.hook.pytest_report_to_serializable(config=config, report=r) for r in reports]
        gathered = comm.gather_object((slot.index, slot.ranks.index(comm.rank), serial) if slot else None, 0)
        stop = False
        if comm.rank == 0:
            self._log_wave(session, wave, specs, gathered)
            stop = bool(session.shouldfail or session.shouldstop)
        return bool(comm.broadcast_object(stop, 0))

    def _log_wave(self, session: Any, wave: list[Slot], specs: list[Any], gathered: list[Any]) -> None:
        config = session.config
        by_test: dict[int, dict[int, dict[str, Any]]] = {}
        for entry in gathered:
            if entry is None:
                continue
            index, rank, serial = entry
            by_test.setdefault(index, {})[rank] = {
                d["when"]: config.hook.pytest_report_from_serializable(config=config, data=d) for d in serial}
        for slot in wave:
            item = session.items[slot.index]
            per_rank = by_test.get(slot.index, {})
            if specs[slot.index] is None:
                self._log(item, list(per_rank.get(0, {}).values()))
                continue
            out = []
            for when in ("setup", "call", "teardown"):
                reps = {r: phases[when] for r, phases in per_rank.items() if when in phases}
                if reps:
                    out.append(merge(item, when, len(slot.ranks), reps, {}))
            self._log(item, out)

    @staticmethod
    def _log(item: Any, reports: list[Any]) -> None:
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        for rep in reports:
            ihook.pytest_runtest_logreport(report=rep)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)


def _skip(item: Any, why: str) -> tuple[str, int, str]:
    return (item.location[0], (item.location[1] or 0) + 1, f"Skipped: {why}")
