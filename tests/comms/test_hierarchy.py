"""The hierarchy's pure decisions (spmd.comms.hierarchy) on fake inputs: hosts and leaders, when it applies,
which arrays go by host, what names a host; and a communicator's wiring of them."""

import numpy as np
import pytest
import torch

from spmd.errors import CollectiveError
from spmd.comms.hierarchy import MIN_BYTES, Hosts, host_key, takes, wanted
from spmd.config.placement import Placement, regroup

pytestmark = pytest.mark.unit


def test_hosts_group_ranks_in_order_of_their_first_rank():
    hosts = Hosts.of(["b", "a", "b", "a", "c"])
    assert hosts.groups == ((0, 2), (1, 3), (4,))
    assert [hosts.host(r) for r in range(5)] == [0, 1, 0, 1, 2]
    assert [hosts.leader(r) for r in range(5)] == [0, 1, 0, 1, 4]
    with pytest.raises(CollectiveError, match="rank 7 is on none of the hosts"):
        hosts.host(7)


@pytest.mark.parametrize("keys, worth", [
    (["h1", "h1", "h2", "h2"], True),
    (["h1", "h1", "h1", "h2"], True),  # uneven: h2's rank is its own leader
    (["h1", "h2", "h3"], False),  # one rank a host: nothing to gather first
    (["h1"] * 4, False),  # one host: the flat path stays within it
])
def test_grouping_pays_across_hosts_holding_several_ranks(keys, worth):
    assert Hosts.of(keys).worth is worth


@pytest.mark.parametrize("args, expected", [
    (("auto", "gloo", 4, True, 2), True),
    (("auto", "gloo", 4, True, None), True),  # no placement: the hosts are gathered
    (("auto", "gloo", 4, True, 1), False),  # measured at init: one node
    (("auto", "mpi", 4, True, 2), False),  # MPI's own all_reduce, by measurement
    (("on", "mpi", 4, True, 2), True),
    (("on", "gloo", 4, True, 1), True),  # asked for: the hosts decide (one host: flat)
    (("auto", "nccl", 4, True, 2), False),
    (("on", "nccl", 4, True, 2), False),
    (("off", "gloo", 4, True, 2), False),
    (("auto", "gloo", 4, False, 2), False),  # a split: only a world's ranks all make the groups
    (("on", "gloo", 2, True, 2), False),  # two ranks: nothing to gather within a host
])
def test_when_a_communicator_looks_for_its_hosts(args, expected):
    assert wanted(*args) is expected


def test_large_contiguous_real_arrays_go_by_host():
    n = MIN_BYTES // 4
    assert takes(np.zeros(n, np.float32)) and takes(np.zeros(n, np.int32))
    assert not takes(np.zeros(n - 1, np.float32))  # small: flat
    assert not takes(np.zeros((n, 2), np.float32)[:, 0])  # a strided view
    assert not takes(np.zeros(n, np.complex64)) and not takes(np.zeros(4 * n, np.bool_))
    assert takes(torch.zeros(n)) and takes(torch.zeros(n, dtype=torch.int32))
    assert takes(torch.nn.Parameter(torch.zeros(n)))
    assert not takes(torch.zeros(n - 1)) and not takes(torch.zeros(n, 2)[:, 0])
    assert not takes(torch.zeros(4 * n, dtype=torch.bool)) and not takes(torch.zeros(n, dtype=torch.complex64))
    assert not takes([np.zeros(n, np.float32)])  # a list goes by host as its flat buffer


def test_a_host_is_named_by_the_node_spmd_measured_else_by_its_name():
    p = Placement(rank=1, size=4, local_rank=1, local_size=2, node_rank=0, num_nodes=2, launcher="mpirun")
    assert host_key(p).startswith("name ")  # the launcher's numbers: not trusted
    measured = regroup(p, [0, 1, 1, 0], "ranks grouped by host over MPI")
    assert host_key(measured) == "node 1"
    assert host_key(None).startswith("name ")


def test_only_a_world_looks_for_its_hosts():
    from spmd.comms.backends.serial import SerialBackend
    from spmd.comms.comm import Comm
    from spmd.failfast.calls import Monitor

    class Four(SerialBackend):
        name, size = "gloo", 4

    assert Comm(Four(), None, None, "on")._hierarchy is not None
    assert Comm(Four(), None, None, "off")._hierarchy is None
    assert Comm(Four(), None, None, "auto")._hierarchy is not None
    world = Monitor()
    assert Comm(Four(), None, world.child(), "on")._hierarchy is None  # a split's monitor
