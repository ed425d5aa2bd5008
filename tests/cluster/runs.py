"""Jobs on the private cluster with a hard time limit: mpiexec from the login host, a command on a host,
and the output read as it comes."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time

import pytest

from tests.support import BIN, PY, REPO, clean_env, finish, tool

MPIEXEC = tool("mpiexec")


def env(**extra):
    """A job's environment: clean, this venv's commands first, a short SPMD_TIMEOUT unless given."""
    extra.setdefault("SPMD_TIMEOUT", "60")
    out = clean_env(**extra)
    out["PATH"] = f"{BIN}{os.pathsep}{out.get('PATH', '')}"
    return out


def mpiexec(lab, args, hosts=None, timeout=180, **extra):
    """Run MPICH's mpiexec from the login host over hosts (default: every compute host); return the
    CompletedProcess (stdout and stderr together), failing the test if it outlives timeout."""
    if MPIEXEC is None:
        pytest.fail("MPICH's mpiexec is missing: run bin/setup")
    cmd = lab.mpiexec_args(MPIEXEC, [str(a) for a in args], hosts)
    return finish(lab.popen("login", cmd, env(**extra)), timeout, "mpiexec across the lab's hosts")


def on(lab, host, cmd, timeout=180, **extra):
    """Run cmd on host to its end; return the CompletedProcess (failing the test after timeout)."""
    return finish(lab.popen(host, [str(c) for c in cmd], env(**extra)), timeout, f"{cmd[0]} on {host}")


class Watched:
    """A job whose output lines are read as they come, by a thread, so a test can wait for one."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self._queue = proc, [], queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern, count=1, timeout=120):
        """Wait until count lines match pattern; fail with the output when the job ends or time runs out."""
        deadline = time.monotonic() + timeout
        while sum(bool(re.search(pattern, line)) for line in self.lines) < count:
            try:
                line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if line is None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"no {count} lines matching {pattern!r} within {timeout} s:\n{self.text()[-4000:]}")
            if line:
                self.lines.append(line)

    def drain(self, seconds):
        """Read what comes for seconds (or until the job ends); return the text so far."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
        return self.text()

    def text(self):
        return "".join(self.lines)

    def kill(self):
        try:
            os.killpg(self.proc.pid, 9)
        except ProcessLookupError:
            pass
        self.proc.wait()


def hosts_rows(out):
    """The rows of tests/worlds/hosts.py's HOSTS line."""
    found = re.search(r"^HOSTS (.*)$", out, re.M)
    assert found, f"no HOSTS line in:\n{out[-4000:]}"
    return json.loads(found.group(1))


HOSTS_PY = REPO / "tests" / "worlds" / "hosts.py"
__all__ = ["mpiexec", "on", "env", "Watched", "hosts_rows", "HOSTS_PY", "PY", "sys"]
