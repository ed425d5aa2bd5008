"""The pair check before gloo's mesh: probe's words for each answer, and check_pairs over a star of threads."""

import socket

import pytest

from spmd.errors import RendezvousError
from spmd.runtime.pairs import check_pairs, describe_failures, probe
from spmd.runtime.star import StoreStar
from tests.runtime.stars import DictStore, ranks

pytestmark = pytest.mark.unit


def test_probe_says_ok_and_refused():
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert probe("127.0.0.1", server.getsockname()[1], 2) is None
        port = server.getsockname()[1]
    assert "refused" in probe("127.0.0.1", port, 2)


def run_hosts(hosts, addresses):
    """check_pairs on one thread per host; return each host's error text (None when it passed)."""
    def one(star):
        try:
            check_pairs(star, star.rank, True, hosts, f"h{star.rank + 1}", addresses[star.rank], "lo", 5)
        except RendezvousError as exc:
            return str(exc)

    return ranks(hosts, one)


def test_every_pair_connects_on_loopback():
    assert run_hosts(3, ["127.0.0.1", "127.0.0.2", "127.0.0.3"]) == [None, None, None]


def test_one_host_needs_no_check():
    check_pairs(StoreStar(DictStore(), 0, 1), 0, True, 1, "h1", "127.0.0.1", "lo", 5)  # at once, no store used


def test_describe_names_each_pair_and_the_way_out():
    text = describe_failures([{"a": "h2", "b": "h3", "address": "198.18.0.13", "port": 4000, "interface": "eth0",
                               "error": "no answer within 5 s: a firewall that drops packets, or a partition"}], 6)
    assert text.startswith("1 of 6 connections between hosts failed")
    assert "h2 -> h3: 198.18.0.13:4000 (eth0): no answer within 5 s" in text and "SPMD_IFNAME" in text


def test_a_failure_is_raised_on_every_host(monkeypatch):
    """A refusal between h2 and h3 (h3's listener closed at once) is every host's error, naming the pair."""
    import spmd.runtime.pairs as pairs

    real = pairs.probe
    monkeypatch.setattr(pairs, "probe", lambda a, p, s: "refused after 0.0 s: a firewall that rejects the port"
                        if a == "127.0.0.3" else real(a, p, s))
    out = run_hosts(3, ["127.0.0.1", "127.0.0.2", "127.0.0.3"])
    assert all(text and "h1 -> h3" in text and "h2 -> h3" in text and "h3 ->" not in text for text in out), out


@pytest.mark.parametrize("environ", [
    {"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "4", "PMI_FD": "999"},  # one host
    {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
     "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},  # not Hydra
])
def test_the_check_before_mpi_init_runs_only_under_hydra_across_hosts(environ):
    """On one host, or under another launcher, it costs nothing: no PMI connection is even opened (fd 999)."""
    from spmd.config.placement import detect
    from spmd.runtime.pairs import before_mpi_init

    assert before_mpi_init(detect(environ), environ, 5) is False
