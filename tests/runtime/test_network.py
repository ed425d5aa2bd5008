"""Tests of spmd.runtime.network: which ranks share a host, and which address and interface each uses."""

import socket
import subprocess
import sys

import pytest

from spmd.errors import RendezvousError
from spmd.runtime.network import (Address, HostCard, choose_server, choose_toward, daemon_interface, daemon_links,
                                  host_of_address, hosts_of, local_card, loopback_name_note, route_source,
                                  user_interface)

pytestmark = pytest.mark.unit

LO = Address("lo", "127.0.0.1", 8)
DOCK = Address("dock0", "198.19.255.1", 24)  # the same bridge address on every host


def card(name, *addresses, resolves_to=("10.9.9.9",)):
    """A host card whose key is its name (one card per host unless two share a name)."""
    return HostCard(name, f"{name}/boot", (LO, *addresses), resolves_to)


def eth0(n, prefix=24):
    return Address("eth0", f"198.18.0.1{n}", prefix)


H0, H1, H2 = (card(f"h{n}", DOCK, eth0(n)) for n in range(3))


# --- hosts_of ----------------------------------------------------------------------

def test_hosts_are_numbered_in_order_of_first_rank():
    a, b, c = card("a"), card("b"), card("c")
    assert hosts_of([b, b, a, c, a]) == [0, 0, 1, 2, 1]
    assert hosts_of([]) == []


def test_round_robin_placement():
    a, b = card("a"), card("b")
    assert hosts_of([a, b, a, b]) == [0, 1, 0, 1]


def test_hosts_are_told_apart_by_key_not_name():
    """Two machines with one hostname (cloned images) are two hosts."""
    first, second = HostCard("node", "node/boot-1"), HostCard("node", "node/boot-2")
    assert hosts_of([first, second, first]) == [0, 1, 0]


# --- user_interface ------------------------------------------------------------------

@pytest.mark.parametrize("environ, want", [
    ({}, None),
    ({"SPMD_IFNAME": "ib0"}, ("SPMD_IFNAME", "ib0")),
    ({"GLOO_SOCKET_IFNAME": "eth1"}, ("GLOO_SOCKET_IFNAME", "eth1")),
    ({"GLOO_SOCKET_IFNAME": " eth1 , eth0"}, ("GLOO_SOCKET_IFNAME", "eth1")),
    ({"SPMD_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth1"}, ("SPMD_IFNAME", "ib0")),
    ({"SPMD_IFNAME": "  ", "GLOO_SOCKET_IFNAME": "eth1"}, ("GLOO_SOCKET_IFNAME", "eth1")),
    ({"SPMD_IFNAME": "", "GLOO_SOCKET_IFNAME": ""}, None),
])
def test_user_interface(environ, want):
    assert user_interface(environ) == want


# --- choose_server -------------------------------------------------------------------

def test_one_host_serves_on_loopback():
    rank1 = HostCard("h0", H0.key, H0.addresses)  # a second rank of the same host
    choice = choose_server(H0, [H0, rank1], {})
    assert (choice.address, choice.interface, choice.reaches_all) == ("127.0.0.1", "lo", True)


def test_an_address_every_host_holds_is_nobodys_link():
    """dock0 is listed first and its network is everyone's, but its address is everyone's too."""
    choice = choose_server(H0, [H0, H1, H2, H1], {})
    assert (choice.address, choice.interface, choice.reaches_all) == ("198.18.0.10", "eth0", True)
    assert "198.18.0.0/24" in choice.why and "h1, h2" in choice.why


def test_the_network_shared_with_most_hosts_wins_but_does_not_reach_all():
    me = card("h0", Address("ib0", "10.1.0.10", 16), eth0(0))
    h1 = card("h1", Address("ib0", "10.1.0.11", 16), eth0(1))
    h2 = card("h2", Address("ib0", "10.1.0.12", 16))
    h3 = card("h3", Address("wlan0", "192.168.7.3", 24))
    choice = choose_server(me, [me, h1, h2, h3], {})
    assert (choice.interface, choice.reaches_all) == ("ib0", False)
    assert "shared with 2 of the 3 other hosts" in choice.why


def test_a_lone_network_still_gives_an_address():
    me = card("h0", Address("eth0", "10.0.0.1", 24))
    choice = choose_server(me, [me, H1, H2], {})
    assert (choice.address, choice.interface, choice.reaches_all) == ("10.0.0.1", "eth0", False)
    assert "no other host" in choice.why


def test_a_lone_network_prefers_an_interface_that_is_up():
    me = card("h0", Address("br0", "172.17.0.1", 16, up=False), Address("eth0", "10.0.0.1", 24))
    choice = choose_server(me, [me, H1], {})
    assert choice.interface == "eth0"


def test_an_interface_without_carrier_is_not_chosen_over_one_with():
    down = Address("eth0", "198.18.0.10", 24, up=False)
    me = card("h0", down, Address("eth1", "198.18.0.20", 24))
    assert choose_server(me, [me, H1], {}).interface == "eth1"


def test_ipv4_is_preferred_to_ipv6_on_equal_reach():
    me = card("h0", Address("eth0", "fd00::10", 64), eth0(0))
    h1 = card("h1", Address("eth0", "fd00::11", 64), eth0(1))
    assert choose_server(me, [me, h1], {}).address == "198.18.0.10"


def test_spmd_ifname_names_the_interface():
    choice = choose_server(H0, [H0, H1], {"SPMD_IFNAME": "dock0", "GLOO_SOCKET_IFNAME": "eth0"})
    assert (choice.address, choice.interface, choice.why) == ("198.19.255.1", "dock0", "SPMD_IFNAME=dock0")
    assert choice.reaches_all


def test_gloo_socket_ifname_when_spmd_ifname_is_unset():
    choice = choose_server(H0, [H0, H1], {"GLOO_SOCKET_IFNAME": "dock0,eth0"})
    assert (choice.interface, choice.why) == ("dock0", "GLOO_SOCKET_IFNAME=dock0")


def test_the_user_interface_wins_even_on_one_host():
    assert choose_server(H0, [H0, H0], {"SPMD_IFNAME": "eth0"}).address == "198.18.0.10"


def test_a_missing_user_interface_is_an_error_that_says_what_there_is():
    with pytest.raises(RendezvousError) as info:
        choose_server(H0, [H0, H1], {"SPMD_IFNAME": "ib0"})
    text = str(info.value)
    for needle in ("SPMD_IFNAME=ib0", "host h0", "lo (127.0.0.1)", "dock0 (198.19.255.1)", "eth0 (198.18.0.10)"):
        assert needle in text


def test_a_host_with_loopback_only_cannot_serve():
    me = card("lonely")
    with pytest.raises(RendezvousError) as info:
        choose_server(me, [me, H1, H2], {})
    assert "host lonely" in str(info.value) and "h1, h2" in str(info.value)
    assert "SPMD_IFNAME" in str(info.value)


# --- choose_toward -------------------------------------------------------------------

ME = card("me", Address("eth0", "10.0.0.5", 24), Address("ib0", "192.168.0.5", 24))


def test_toward_an_address_on_one_of_my_networks():
    """The network holding the target wins over the kernel's route."""
    choice = choose_toward(ME, "192.168.0.1", "10.0.0.5", {})
    assert (choice.address, choice.interface) == ("192.168.0.5", "ib0")
    assert "192.168.0.0/24" in choice.why and "192.168.0.1" in choice.why


def test_toward_an_address_on_a_network_whose_interface_is_down():
    me = card("me", Address("ib0", "192.168.0.5", 24, up=False), Address("eth0", "10.0.0.5", 24))
    assert choose_toward(me, "192.168.0.1", "10.0.0.5", {}).interface == "eth0"


def test_toward_an_address_off_my_networks_follows_the_route():
    choice = choose_toward(ME, "203.0.113.7", "192.168.0.5", {})
    assert (choice.address, choice.interface) == ("192.168.0.5", "ib0")
    assert choice.why == "the route to the rendezvous address 203.0.113.7"


def test_toward_a_host_name_follows_the_route():
    assert choose_toward(ME, "node01", "192.168.0.5", {}).interface == "ib0"


def test_toward_loopback_without_a_route_takes_the_first_outward_interface():
    choice = choose_toward(ME, "127.0.0.1", None, {})
    assert (choice.address, choice.interface) == ("10.0.0.5", "eth0")
    assert choice.why.startswith("its first interface up") and "no interface" in choice.why


def test_toward_loopback_by_a_loopback_route_never_takes_loopback():
    choice = choose_toward(ME, "127.0.0.1", "127.0.0.1", {})
    assert choice.interface == "eth0" and "leaves by loopback" in choice.why


def test_the_first_interface_up_is_taken_over_one_without_carrier():
    me = card("me", Address("br0", "172.17.0.1", 16, up=False), Address("eth0", "10.0.0.5", 24))
    assert choose_toward(me, "203.0.113.7", None, {}).interface == "eth0"


def test_toward_on_the_same_host_is_loopback():
    choice = choose_toward(ME, "192.168.0.1", "10.0.0.5", {}, same_host=True)
    assert (choice.address, choice.interface) == ("127.0.0.1", "lo")


def test_toward_with_the_user_interface():
    environ = {"GLOO_SOCKET_IFNAME": "eth0"}
    assert choose_toward(ME, "192.168.0.1", "192.168.0.5", environ).interface == "eth0"
    assert choose_toward(ME, "192.168.0.1", None, environ, same_host=True).address == "10.0.0.5"
    with pytest.raises(RendezvousError, match="SPMD_IFNAME=wlan0"):
        choose_toward(ME, "192.168.0.1", None, {"SPMD_IFNAME": "wlan0"})


def test_toward_from_a_host_with_loopback_only_is_an_error():
    with pytest.raises(RendezvousError, match="host lonely has no address but loopback"):
        choose_toward(card("lonely"), "10.0.0.1", "127.0.0.1", {})


def test_toward_an_ipv6_address():
    me = card("me", Address("eth0", "10.0.0.5", 24), Address("ib0", "fd00::5", 64))
    assert choose_toward(me, "fd00::1", None, {}).address == "fd00::5"


# --- HostCard.outward ----------------------------------------------------------------

def test_outward_drops_loopback_and_puts_ipv4_first():
    me = card("me", Address("eth0", "fd00::5", 64), Address("lo", "::1", 128), Address("eth0", "10.0.0.5", 24),
              Address("ib0", "192.168.0.5", 24))
    assert [a.ip for a in me.outward()] == ["10.0.0.5", "192.168.0.5", "fd00::5"]


# --- loopback_name_note --------------------------------------------------------------

@pytest.mark.parametrize("resolves_to", [("127.0.1.1",), ("::1", "127.0.0.1")])
def test_a_name_resolving_to_loopback_only_is_noted(resolves_to):
    note = loopback_name_note(card("deb", resolves_to=resolves_to))
    assert note.startswith("deb resolves its own name to") and "loopback" in note
    assert resolves_to[0] in note


def test_an_unresolvable_name_is_noted():
    assert loopback_name_note(card("ghost", resolves_to=())) == "ghost cannot resolve its own name"


@pytest.mark.parametrize("resolves_to", [("10.0.0.5",), ("127.0.1.1", "10.0.0.5")])
def test_a_name_resolving_to_a_real_address_is_not_noted(resolves_to):
    assert loopback_name_note(card("ok", resolves_to=resolves_to)) is None


# --- host_of_address -----------------------------------------------------------------

def test_host_of_address():
    assert host_of_address("198.18.0.11", [H0, H1, H2]) == "h1"
    assert host_of_address("198.18.0.11", [H0, H1, H1]) == "h1"  # two ranks on h1
    assert host_of_address("198.19.255.1", [H0, H1, H2]) is None  # held by every host
    assert host_of_address("127.0.0.1", [H0]) is None  # loopback is nobody's
    assert host_of_address("203.0.113.7", [H0, H1]) is None


# --- the system --------------------------------------------------------------------

def test_local_card_reads_this_host():
    mine = local_card()
    assert mine.name == socket.gethostname() and mine.name in mine.key
    assert any(a.ip == "127.0.0.1" and a.loopback for a in mine.addresses)
    assert route_source("127.0.0.1") == "127.0.0.1"


# --- daemon_interface, daemon_links: Open MPI's own link, before MPI_Init --------------------------

LAN = Address("lan1", "198.19.1.1", 24)


def test_the_daemons_interface_is_the_one_holding_its_links():
    assert daemon_interface(card("h1", DOCK, LAN, eth0(1)), ["198.18.0.11", "127.0.0.1"]) == eth0(1)
    assert daemon_interface(card("h1", DOCK, eth0(1)), ["198.18.0.11", "198.19.255.1", "198.18.0.11"]) == eth0(1)


def test_no_daemon_link_or_one_interface_chooses_nothing():
    assert daemon_interface(card("h1", DOCK, eth0(1)), []) is None  # one host: no daemon connections
    assert daemon_interface(card("h1", DOCK, eth0(1)), ["127.0.0.1"]) is None
    assert daemon_interface(card("h1", eth0(1)), ["198.18.0.11"]) is None  # nothing to choose


DAEMON = """
import socket, sys, subprocess
open("/proc/self/comm", "w").write("prted")
server = socket.create_server(("127.0.0.1", 0))
link = socket.create_connection(server.getsockname())
child = subprocess.run([sys.executable, "-c", "from spmd.runtime.network import daemon_links; print(daemon_links())"],
                       capture_output=True, text=True, timeout=60)
print(child.stdout, child.stderr)
"""


def test_daemon_links_are_the_connections_of_the_nearest_daemon_ancestor():
    """A parent named prted holding one established connection: its child finds that connection."""
    out = subprocess.run([sys.executable, "-c", DAEMON], capture_output=True, text=True, timeout=60).stdout
    assert out.strip() == "['127.0.0.1']", out
    assert daemon_links(("no-such-daemon",)) == []
