"""Plain ``pytest``: the controller's side, which runs each marked test on forked ranks.

``RankServer`` starts the fork server (spmd.testing.collected) once, at the
first marked test, with this session's arguments, and asks it to run one
test at a time; ``LocalRanks`` is the plugin that sends each marked test
there and logs pytest's reports of it, merged from its ranks' reports
(spmd.testing.merge).  Unmarked tests run here, as usual.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from spmd.util import pickled
from spmd.testing.marks import size_of, spec_of
from spmd.testing.merge import merge, synthetic
from spmd.testing.watch import ASK, GRACE, MARGIN

__all__ = ["RankServer", "LocalRanks", "STARTUP"]

#: Seconds the fork server may take to collect the tests and get ready.
STARTUP = 300.0


class RankServer:
    """The fork server of this session: started on first use, restarted after it fails."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: Any = None
        self.refused: str | None = None

    def _args(self) -> list[str]:
        params = self.config.invocation_params
        base = self.config._tmp_path_factory.getbasetemp() / "spmd-ranks"
        return [*params.args, f"--basetemp={base}"]

    def start(self) -> str | None:
        """Start the server and wait until it is ready; return why it cannot serve, or None."""
        mine, theirs = pickled.pair()
        env = dict(os.environ, SPMD_PYTEST_SERVER="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spmd.testing.collected", str(theirs.fileno()), *self._args()],
            pass_fds=[theirs.fileno()], cwd=self.config.invocation_params.dir, env=env,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        theirs.close()
        self.sock = mine
        mine.settimeout(STARTUP)
        try:
            ready = pickled.recv(mine)
        except OSError:
            ready = None
        mine.settimeout(None)
        if not ready or not ready.get("ready"):
            error = (ready or {}).get("error") or "the rank server ended before it was ready: see its output above"
            self.close()
            return error
        self.refused = ready.get("refused")
        return None

    def run(self, nodeid: str, size: int, backend: str, timeout: float, following: str | None = None) -> dict[str, Any]:
        """Run one test on the server; a dict with 'error' when the server could not."""
        if self.proc is None or self.proc.poll() is not None:
            error = self.start()
            if error:
                return {"error": error}
        pickled.send(self.sock, {"nodeid": nodeid, "size": size, "backend": backend, "timeout": timeout,
                              "next": following})
        self.sock.settimeout(timeout + MARGIN + GRACE + 2 * ASK + 30.0)
        try:
            result = pickled.recv(self.sock)
        except OSError:  # (socket.timeout) the server itself hangs
            result = None
        self.sock.settimeout(None)
        if result is None:
            status = self.proc.poll()
            self.close()
            return {"error": f"the rank server {'exited with status ' + str(status) if status is not None else 'did not answer'}"
                             " while running this test; it is restarted for the next one"}
        return result

    def close(self) -> None:
        """End the server and every rank it forked (they die with it)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.wait(timeout=2.0)  # an idle server ends at once; one in a test (an interrupt) is killed
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class LocalRanks:
    """The plugin of plain pytest: marked tests run on the rank server, the rest here."""

    def __init__(self, config: Any, timeout: float) -> None:
        self.config, self.timeout = config, timeout
        self.server = RankServer(config)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: Any, nextitem: Any) -> bool | None:
        spec = spec_of(item)
        if spec is None:
            return None
        size = size_of(item, spec)
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        reports = self._reports(item, spec, size, nextitem)
        # What this session set up for the tests before (a package's fixtures) is torn down as after any test.
        from _pytest.runner import CallInfo

        down = CallInfo.from_call(lambda: item.session._setupstate.teardown_exact(nextitem), "teardown")
        if down.excinfo is not None:
            reports[-1] = ihook.pytest_runtest_makereport(item=item, call=down)
        for rep in reports:
            ihook.pytest_runtest_logreport(report=rep)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _reports(self, item: Any, spec: Any, size: int, nextitem: Any) -> list[Any]:
        backend = spec.backend or "gloo"
        if backend not in ("gloo", "auto"):
            why = (f"backend {backend!r} needs a launcher: run `mpirun -n {size} pytest` (or srun, torchrun, "
                   f"`spmd run -n {size} -m pytest`); plain pytest starts gloo ranks")
            path, lineno = item.location[0], (item.location[1] or 0) + 1
            return [synthetic(item, "setup", "skipped", (path, lineno, f"Skipped: {why}")),
                    synthetic(item, "teardown", "passed")]
        start = time.monotonic()
        following = None if nextitem is None else nextitem.nodeid
        result = self.server.run(item.nodeid, size, "gloo", spec.timeout or self.timeout, following)
        if "error" in result:
            rep = synthetic(item, "setup", "failed", f"spmd: {result['error']}")
            rep.duration = time.monotonic() - start
            return [rep, synthetic(item, "teardown", "passed")]
        return _phases(item, result, self.config)

    def pytest_sessionfinish(self, session: Any) -> None:
        self.server.close()


def _phases(item: Any, result: dict[str, Any], config: Any) -> list[Any]:
    size = result["size"]
    per_rank: dict[int, dict[str, Any]] = {}
    for rank, dicts in result["reports"].items():
        per_rank[rank] = {d["when"]: config.hook.pytest_report_from_serializable(config=config, data=d)
                          for d in dicts}
    endings = result["endings"]
    out = []
    for when in ("setup", "call", "teardown"):
        reps = {r: phases[when] for r, phases in per_rank.items() if when in phases}
        ended = {r: e["text"] for r, e in endings.items() if e["phase"] == when}
        if not reps and not ended:
            if when == "teardown":
                out.append(synthetic(item, "teardown", "passed"))
            continue
        rep = merge(item, when, size, reps, ended, result.get("why"), result.get("stacks"))
        out.append(rep)
        if when == "setup" and not rep.passed:
            when_next = [r for r in per_rank.values() if "teardown" in r]
            td = {r: phases["teardown"] for r, phases in per_rank.items() if "teardown" in phases}
            out.append(merge(item, "teardown", size, td, {}) if when_next else synthetic(item, "teardown", "passed"))
            break
    return out
