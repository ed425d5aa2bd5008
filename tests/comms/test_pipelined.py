"""The chain and the ring's pure parts (spmd.comms.pipelined) on fake inputs: pieces, who sends to whom,
when a communicator takes them, which arrays; and one rank's run of the chain and the ring over a fake
point to point."""

import threading

import numpy as np
import pytest
import torch

from spmd.comms import pipelined
from spmd.comms.pipelined import MIN_BYTES, PIECE, TAG, chain, nbytes, pieces, ring, wanted
from spmd.comms.p2p.incoming import TAG_STRIDE

pytestmark = pytest.mark.unit


def test_pieces_cover_the_bytes_in_order_each_at_most_a_piece():
    assert pieces(0) == []
    assert pieces(5, 2) == [(0, 2), (2, 4), (4, 5)]
    spans = pieces(3 * PIECE + 7)
    assert spans[0] == (0, PIECE) and spans[-1] == (3 * PIECE, 3 * PIECE + 7) and len(spans) == 4
    assert all(a == z for (_, a), (z, _) in zip(spans, spans[1:]))


@pytest.mark.parametrize("size, root", [(4, 0), (4, 2), (5, 3), (2, 1)])
def test_the_chain_runs_from_root_through_every_rank_once_in_rank_order(size, root):
    links = {r: chain(r, size, root) for r in range(size)}
    assert links[root][0] is None
    order, r = [root], root
    while links[r][1] is not None:
        nxt = links[r][1]
        assert links[nxt][0] == r  # the next rank receives from this one
        order.append(nxt)
        r = nxt
    assert order == [(root + i) % size for i in range(size)]


@pytest.mark.parametrize("size", [2, 3, 4, 7])
def test_the_ring_sends_each_block_on_after_receiving_it_and_every_rank_gets_every_block(size):
    for rank in range(size):
        steps = ring(rank, size)
        assert len(steps) == size - 1 and steps[0][0] == rank  # its own block first
        assert all(steps[s][0] == steps[s - 1][1] for s in range(1, size - 1))  # what came, goes on
        assert {rank} | {got for _, got in steps} == set(range(size))
        # what rank sends at step s is what rank + 1 receives at step s
        nxt = ring((rank + 1) % size, size)
        assert [sent for sent, _ in steps] == [got for _, got in nxt]


def test_its_tag_is_no_users_message():
    assert TAG % TAG_STRIDE == 0  # user tags are TAG_STRIDE * t + 1..4


@pytest.mark.parametrize("args, expected", [
    (("auto", "gloo", 4, 2), True),
    (("auto", "gloo", 4, None), True),  # unknown: taken
    (("auto", "gloo", 4, 1), False),  # one host: gloo's own (memory, not links, bounds it)
    (("auto", "mpi", 4, 2), False),
    (("on", "mpi", 4, 1), True),
    (("on", "nccl", 4, 2), False),
    (("off", "gloo", 4, 2), False),
    (("on", "gloo", 1, 2), False),
])
def test_when_a_communicator_takes_the_chain_and_the_ring(args, expected):
    assert wanted(*args) is expected


def test_the_bytes_of_cpu_arrays_of_one_dimension_or_more():
    assert nbytes(np.zeros((3, 4), np.float32)) == 48 and nbytes(np.zeros((3, 4), np.float32), 10) == 160
    assert nbytes(np.zeros((0, 4), np.int8), 5) == 20  # a rank with no rows knows a row's bytes
    assert nbytes(torch.zeros(5, 2, dtype=torch.bfloat16)) == 20
    assert nbytes(np.zeros((4, 2))[:, 0]) == 32  # strided: copied through a contiguous array
    assert nbytes(np.float32(3)) == 0 and nbytes(np.zeros(())) == 0 and nbytes(torch.zeros(())) == 0
    assert nbytes([np.zeros(4)]) == 0 and nbytes("x") == 0


class _Net:
    """Point to point among fake ranks in one process (threads): messages by (src, dst), in order; a
    receive's wait blocks until its message came."""

    def __init__(self):
        self.queues = {}
        self.cond = threading.Condition()

    def backend(self, rank, size):
        net = self

        class B:
            def __init__(self):
                self.rank, self.size = rank, size

            def send(self, x, dst, tag, async_op):
                assert tag == TAG and async_op
                with net.cond:
                    net.queues.setdefault((rank, dst), []).append(x.copy())
                    net.cond.notify_all()
                return _Wait(lambda: None)

            def recv(self, x, src, tag, async_op):
                assert tag == TAG and async_op

                def fill():
                    with net.cond:
                        assert net.cond.wait_for(lambda: net.queues.get((src, rank)), timeout=10)
                        x[:] = net.queues[(src, rank)].pop(0)

                return _Wait(fill)

        return B()

    def run(self, size, fn):
        """fn(backend) on every rank at once, in threads; raise the first error."""
        errors = []

        def one(r):
            try:
                fn(self.backend(r, size))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(r,)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not errors, errors


class _Wait:
    def __init__(self, fn):
        self.wait = fn


def test_the_chain_moves_root_bytes_piece_by_piece_to_every_rank_in_chain_order():
    size, root, n = 4, 2, 3 * PIECE + 5
    net, want = _Net(), np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    data = {r: (want.copy() if r == root else np.zeros(n, np.uint8)) for r in range(size)}
    net.run(size, lambda b: pipelined._chain(b, data[b.rank], root))
    assert all((data[r] == want).all() for r in range(size))
    assert set(net.queues) == {(2, 3), (3, 0), (0, 1)} and not any(net.queues.values())


def test_the_ring_gathers_every_block_uneven_and_empty_ones_included():
    size, lengths = 3, [0, 2 * PIECE + 3, PIECE]
    want = [np.full(n, r + 1, np.uint8) for r, n in enumerate(lengths)]
    blocks = {r: [want[b].copy() if b == r else np.zeros(n, np.uint8) for b, n in enumerate(lengths)]
              for r in range(size)}
    net = _Net()
    net.run(size, lambda b: pipelined._ring(b, blocks[b.rank]))
    assert all((blocks[r][b] == want[b]).all() for r in range(size) for b in range(size))
    assert set(net.queues) == {(0, 1), (1, 2), (2, 0)} and not any(net.queues.values())


def test_only_large_broadcasts_on_three_ranks_or_more_and_large_gathers_take_them():
    from spmd.comms.backends.serial import SerialBackend
    from spmd.comms.comm import Comm

    def comm(size, mode="on"):
        class Many(SerialBackend):
            name = "gloo"

        b = Many()
        b.size = size
        return Comm(b, None, None, "off", mode)

    assert comm(4, "off")._pipelined is None and comm(4, "auto")._pipelined is not None
    four, two = comm(4)._pipelined, comm(2)._pipelined
    big = np.zeros(MIN_BYTES, np.uint8)
    assert four.chains(big) and not four.chains(big[:-1]) and not two.chains(big)  # two: the plain one
    assert four.rings(big[: MIN_BYTES // 4]) and not four.rings(big[: MIN_BYTES // 4 - 1])
    assert two.rings(big[: MIN_BYTES // 2]) and four.rings(np.zeros((0, 8), np.uint8), MIN_BYTES // 8)
    assert not four.rings([big])
