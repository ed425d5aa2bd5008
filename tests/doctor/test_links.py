"""A host's link server on loopback: only the doctor's members are served, bytes are counted, clocks read."""

import socket
import time

import pytest

from spmd.doctor.links import GREETING, LinkServer, clock_offset, pairings, send_for

pytestmark = pytest.mark.unit

SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture
def server():
    s = LinkServer("127.0.0.1", SECRET)
    yield s
    s.close()


def test_bytes_sent_are_counted_by_the_receiver(server):
    mbps, why = send_for("127.0.0.1", server.port, SECRET, 0.2, 4 * 2**20)
    assert why is None and mbps > 1, why


def test_a_wrong_secret_is_served_nothing(server):
    mbps, why = send_for("127.0.0.1", server.port, b"not the secret at all, no", 0.1, 2**20)
    assert mbps is None and why
    assert clock_offset("127.0.0.1", server.port, b"not the secret at all, no") is None


def test_an_outsider_that_says_nothing_or_garbage_does_not_stop_the_server(server):
    idle = socket.create_connection(("127.0.0.1", server.port))
    assert idle.recv(len(GREETING)) == GREETING
    with socket.create_connection(("127.0.0.1", server.port)) as rude:
        rude.sendall(b"GET / HTTP/1.0\r\n\r\n" * 100)
    for _ in range(40):  # more than it serves at once
        socket.create_connection(("127.0.0.1", server.port)).close()
    time.sleep(0.1)
    mbps, why = send_for("127.0.0.1", server.port, SECRET, 0.1, 2**20)
    assert why is None and mbps > 0
    idle.close()


def test_the_clock_of_this_host_against_itself_is_near_zero(server):
    offset = clock_offset("127.0.0.1", server.port, SECRET)
    assert offset is not None and abs(offset) < 0.05


def test_a_closed_port_is_a_reason_not_a_hang():
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    started = time.monotonic()
    mbps, why = send_for("127.0.0.1", port, SECRET, 0.1, 2**20)
    assert mbps is None and "refused" in why.lower() and time.monotonic() - started < 2


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8])
def test_pairings_meet_every_pair_once_one_partner_a_round(n):
    rounds = pairings(list(range(n)))
    met = [frozenset(p) for r in rounds for p in r]
    assert sorted(map(sorted, met)) == sorted([a, b] for a in range(n) for b in range(a + 1, n))
    assert all(len({h for p in r for h in p}) == 2 * len(r) for r in rounds)
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)
