"""The fork server starts a test's body only when every rank is ready (spmd.testing.watch._Watch)."""

import select
import subprocess
import threading
import time

import pytest

from spmd.util import pickled
from spmd.testing.watch import _Rank, _Watch

pytestmark = pytest.mark.unit


class _Ranks:
    """n ranks as the server sees them: a socket each, and a real process to reap when one goes."""

    def __init__(self, n):
        self.procs = [subprocess.Popen(["sleep", "60"]) for _ in range(n)]
        pairs = [pickled.pair() for _ in range(n)]
        self.ranks = [_Rank(r, p.pid, mine) for r, (p, (mine, _)) in enumerate(zip(self.procs, pairs))]
        self.theirs = [theirs for _, theirs in pairs]
        for r in self.ranks:
            r.next_test()
        self.watch = _Watch(self.ranks, timeout=30)
        self.thread = threading.Thread(target=self.watch.run, args=(time.monotonic(),), daemon=True)
        self.thread.start()

    def said_go(self, r, within):
        if not select.select([self.theirs[r]], [], [], within)[0]:
            return False
        return pickled.recv(self.theirs[r]) == "go"

    def end(self):
        for p in self.procs:
            p.kill()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the watch did not end once every rank had finished or gone"
        for p in self.procs:
            p.wait()


def test_no_rank_starts_before_every_rank_is_ready():
    world = _Ranks(3)
    try:
        for r in (0, 1):
            pickled.send(world.theirs[r], {"ready": True})
        early = world.said_go(0, 0.3) or world.said_go(1, 0.0)
        assert not early, "a rank was told to start while rank 2 was not ready"
        pickled.send(world.theirs[2], {"ready": True})
        assert all(world.said_go(r, 10) for r in range(3))
        for r in range(3):
            pickled.send(world.theirs[r], {"done": True, "dirty": False, "world_dirty": False})
    finally:
        world.end()
    assert world.watch.why is None


def test_a_rank_that_failed_its_setup_or_died_lets_the_others_start():
    world = _Ranks(3)
    try:
        pickled.send(world.theirs[0], {"ready": True})
        pickled.send(world.theirs[1], {"done": True})  # its setup failed: it reported and finished
        assert not world.said_go(0, 0.3), "rank 0 was told to start while rank 2 was neither ready nor gone"
        world.procs[2].kill()
        world.theirs[2].close()
        assert world.said_go(0, 10)
        assert not world.said_go(1, 0.3), "a rank that finished was told to start"
        pickled.send(world.theirs[0], {"done": True})
    finally:
        world.end()
    assert world.ranks[2].gone and world.ranks[2].status == -9
