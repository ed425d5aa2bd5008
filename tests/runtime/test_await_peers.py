"""Ranks that never reach the rendezvous (their host died or froze during init): who says so, and what."""

import threading

import pytest

from spmd.errors import RendezvousError
from spmd.runtime.rendezvous import await_peers

pytestmark = pytest.mark.unit


@pytest.fixture
def store():
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _arrive(store, ranks, size, timeout):
    """ranks await the others at once (threads); {rank: the RendezvousError it raised}."""
    raised = {}

    def one(rank):
        try:
            await_peers(store, rank, size, timeout)
        except RendezvousError as exc:
            raised[rank] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return raised


def test_missing_ranks_are_named_once_by_rank_0(store):
    """Ranks 0 and 1 of 4 came: each raises the error naming ranks 2 and 3, marked to be said by rank 0
    alone; the others' said() returns once rank 0 has said it."""
    raised = _arrive(store, [0, 1], 4, 0.3)
    assert sorted(raised) == [0, 1]
    for exc in raised.values():
        assert "only 2 of 4 ranks arrived within 0.3 s; missing ranks [2, 3]" in str(exc)
    assert [raised[r].everywhere[0] for r in (0, 1)] == [0, 1]
    raised[0].everywhere[1]()  # rank 0 has said it
    raised[1].everywhere[1]()  # returns at once


def test_without_rank_0_every_rank_that_came_says_it_itself(store):
    """Rank 0 never came: no rank waits for it to speak, each raises an error of its own."""
    raised = _arrive(store, [1, 2], 3, 0.3)
    assert sorted(raised) == [1, 2]
    assert all("missing ranks [0]" in str(e) and not hasattr(e, "everywhere") for e in raised.values())


def test_a_rank_whose_rank_0_never_speaks_says_it_itself(store, capsys, monkeypatch):
    """Rank 0 came, yet never said the error (the missing arrived before its own deadline): rank 1 waited
    in vain, and prints it."""
    import spmd.runtime.rendezvous as rendezvous

    monkeypatch.setattr(rendezvous, "SAID_WITHIN", 0.2)
    store.set("spmd/arrived/0", "1")
    raised = _arrive(store, [1], 3, 0.3)
    raised[1].everywhere[1]()
    assert "### spmd: rank 1: RendezvousError: only 2 of 3 ranks arrived" in capsys.readouterr().err
