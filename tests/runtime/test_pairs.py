"""The pair check before gloo's mesh: probe's words for each answer, and check_pairs over a star of threads."""

import socket
import threading

import pytest

from spmd.errors import RendezvousError
from spmd.runtime.pairs import check_pairs, describe_failures, probe
from spmd.runtime.star import StoreStar

pytestmark = pytest.mark.unit


class DictStore:
    """What a StoreStar asks of a store, for threads: set, check, a wait that waits, get."""

    def __init__(self):
        self.values, self.cond = {}, threading.Condition()

    def set(self, key, value):
        with self.cond:
            self.values[key] = value.encode() if isinstance(value, str) else value
            self.cond.notify_all()

    def get(self, key):
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.values, timeout=20), f"{key} never set"
            return self.values[key]

    def check(self, keys):
        with self.cond:
            return all(k in self.values for k in keys)

    def wait(self, keys, timeout):
        with self.cond:
            if not self.cond.wait_for(lambda: all(k in self.values for k in keys), timeout=timeout.total_seconds()):
                raise RuntimeError(f"{keys} not set within {timeout}")


def test_probe_says_ok_and_refused():
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert probe("127.0.0.1", server.getsockname()[1], 2) is None
        port = server.getsockname()[1]
    assert "refused" in probe("127.0.0.1", port, 2)


def run_hosts(hosts, addresses):
    """check_pairs on one thread per host; return each host's error text (None when it passed)."""
    store, out = DictStore(), [None] * hosts

    def one(h):
        try:
            check_pairs(StoreStar(store, h, hosts), h, True, hosts, f"h{h + 1}", addresses[h], "lo", 5)
        except RendezvousError as exc:
            out[h] = str(exc)

    threads = [threading.Thread(target=one, args=(h,)) for h in range(hosts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


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
