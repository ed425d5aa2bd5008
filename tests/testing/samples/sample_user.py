"""A user's multi-rank tests: what passes, fails and skips, under plain pytest and under a launcher."""

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def table():
    return np.arange(8.0)


@pytest.mark.spmd(ranks=4)
def test_numpy_and_torch(comm, table, shared_value):
    assert comm.size == 4 and shared_value == 42 and table.sum() == 28
    assert comm.all_reduce(np.ones(2) * comm.rank).tolist() == [6.0, 6.0]
    assert comm.all_reduce(torch.ones(3)).tolist() == [4.0, 4.0, 4.0]
    assert [int(a[0]) for a in comm.all_gather(np.array([comm.rank]))] == [0, 1, 2, 3]
    assert comm.broadcast(torch.arange(3) * (comm.rank + 1), root=2).tolist() == [0, 3, 6]


@pytest.mark.spmd(ranks=[2, 3])
def test_tmp_path_is_one_directory(comm, spmd_ranks, tmp_path):
    assert comm.size == spmd_ranks
    (tmp_path / f"rank{comm.rank}").write_text(str(comm.rank))
    comm.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank{r}" for r in range(comm.size)]


@pytest.mark.spmd(ranks=4)
def test_odd_ranks_fail(comm):
    print(f"rank {comm.rank} speaks")
    value = comm.rank % 2
    assert value == 0


@pytest.mark.spmd(ranks=2)
def test_capsys(comm, capsys):
    print("hello from", comm.rank)
    assert capsys.readouterr().out == f"hello from {comm.rank}\n"


@pytest.mark.spmd(ranks=2)
@pytest.mark.xfail(reason="known to fail", strict=True)
def test_xfail(comm):
    assert comm.rank == 7


@pytest.mark.spmd(ranks=2)
def test_skip_inside(comm):
    pytest.skip("skipped on every rank")


@pytest.mark.spmd(ranks=6)
def test_six(comm):
    assert comm.all_reduce(np.ones(1))[0] == 6


@pytest.mark.spmd(ranks=2)
@pytest.mark.parametrize("x", [1, 2])
def test_with_params(comm, x):
    assert comm.all_reduce(np.array([x]))[0] == 2 * x


def test_unmarked():
    assert 1 + 1 == 2


def test_comm_without_marker(comm):
    pass
