"""A split whose connection fails on one rank: every rank drops what it made and tries again.

The failure is real (rank 1's gloo is given an interface that does not
exist); its partner waits at its own connect until the timeout, then
every rank learns of the failure over the parent and tries again.
"""

import re

import pytest

from tests.support import WORLDS, clean_env, finish, start, tool

pytestmark = pytest.mark.launcher

SCRIPT = str(WORLDS / "flaky_split.py")


def _run(mode):
    proc = start([tool("spmd"), "run", "-n", "4", SCRIPT, mode], clean_env(SPMD_TIMEOUT=5))
    out = finish(proc, 150, f"spmd run -n 4 flaky_split.py {mode}").stdout
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.timeout(200)
def test_a_split_that_fails_once_on_one_rank_is_made_again_on_every_rank():
    out = _run("once")
    pairs = {int(r): (int(n), int(k), float(s)) for r, n, k, s in
             re.findall(r"PAIR (\d) size (\d) rank (\d) sum (\S+)", out)}
    assert pairs == {0: (2, 0, 1.0), 1: (2, 1, 1.0), 2: (2, 0, 5.0), 3: (2, 1, 5.0)}, out[-4000:]
    said = re.findall(r"spmd: connecting a split's communicators failed \((.*)\); every rank tries again "
                      r"\(attempt 2 of 3\)", out)
    assert len(said) == 1 and "rank 1:" in said[0] and "spmd-no-such-if" in said[0], out[-4000:]


@pytest.mark.timeout(200)
def test_a_split_that_always_fails_raises_on_every_rank_with_the_cause():
    out = _run("always")
    raised = dict(re.findall(r"RAISED (\d) (.*)", out))
    assert sorted(raised) == ["0", "1", "2", "3"], out[-4000:]
    for text in raised.values():
        assert text.startswith("split could not connect its communicators in 3 attempts ("), text
        assert re.search(r"rank 1: RuntimeError: .*spmd-no-such-if", text) and "GLOO_SOCKET_IFNAME" in text, text
    assert "PAIR" not in out
