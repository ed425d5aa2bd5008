"""Which address and interface this rank uses to reach the others, and which ranks share a host.

At init each rank describes its host in a :class:`HostCard` (name, an identity two processes
share only on one machine, its addresses, what its own name resolves to); the cards go round
over what already works (MPI's world, or the rendezvous store).  ``hosts_of`` groups ranks by
host; ``choose_server`` picks the address rank 0 serves and publishes; ``choose_toward`` the
interface toward a given rendezvous address.  The order: the user's interface (SPMD_IFNAME,
else GLOO_SOCKET_IFNAME); one host: loopback; an address on a network every other host has an
address on (one held by several hosts, like docker0's, is nobody's link); the kernel's route.
Never loopback toward another host, never a wildcard.  Each choice says why in words (spmd
info, the errors).  Choices are pure; ``local_card``, ``route_source`` and ``daemon_links`` (before
MPI_Init under Open MPI: the addresses its own daemon reached the other hosts from) read the system.
docs/reference.md ("How spmd chooses the network").
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import socket
import struct
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

from spmd.errors import RendezvousError

__all__ = ["Address", "HostCard", "Choice", "local_card", "interfaces", "route_source", "hosts_of",
           "choose_server", "choose_toward", "user_interface", "loopback_name_note", "host_of_address",
           "exchange_over_store", "to_text", "from_text", "resolved", "daemon_links", "socket_inodes",
           "daemon_interface"]

_SIOCGIFADDR, _SIOCGIFNETMASK = 0x8915, 0x891B


@dataclass(frozen=True)
class Address:
    """One address of one interface: its name, the address and the network's prefix length."""

    interface: str
    ip: str
    prefix: int
    up: bool = True  # the interface has a carrier (a bridge with no port has none)

    @property
    def network(self) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
        return ipaddress.ip_network(f"{self.ip}/{self.prefix}", strict=False)

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.ip).is_loopback


@dataclass(frozen=True)
class HostCard:
    """What a rank tells the others of its host."""

    name: str  # the host's name (gethostname)
    key: str  # equal for two processes only on one machine: name, boot id, IPC namespace
    addresses: tuple[Address, ...] = ()
    resolves_to: tuple[str, ...] = ()  # what its own name resolves to there (empty when it does not)

    def outward(self) -> list[Address]:
        """Its addresses that are not loopback, IPv4 first, in interface order."""
        found = [a for a in self.addresses if not a.loopback]
        return sorted(found, key=lambda a: ":" in a.ip)


@dataclass(frozen=True)
class Choice:
    """An address and its interface, with the reason in words."""

    address: str
    interface: str | None
    why: str
    reaches_all: bool = True  # on a network every other host has an address on (or chosen by the user)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _ipv4(name: str) -> Address | None:
    """The IPv4 address and prefix of interface name, or None (ioctl SIOCGIFADDR/SIOCGIFNETMASK)."""
    packed = struct.pack("256s", name.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            ip = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, packed)[20:24])
            mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFNETMASK, packed)[20:24])
        except OSError:
            return None
    prefix = ipaddress.ip_network(f"0.0.0.0/{mask}").prefixlen
    carrier = _read(f"/sys/class/net/{name}/carrier")
    return Address(name, ip, prefix, carrier != "0")


def _ipv6() -> list[Address]:
    """Global IPv6 addresses from /proc/net/if_inet6 (scope 00)."""
    found = []
    for line in _read("/proc/net/if_inet6").splitlines():
        parts = line.split()
        if len(parts) == 6 and parts[3] == "00":
            ip = str(ipaddress.ip_address(bytes.fromhex(parts[0])))
            carrier = _read(f"/sys/class/net/{parts[5]}/carrier")
            found.append(Address(parts[5], ip, int(parts[2], 16), carrier != "0"))
    return found


def interfaces() -> list[Address]:
    """This host's addresses, in interface order (IPv4 of each interface, then global IPv6)."""
    found = []
    for _, name in socket.if_nameindex():
        address = _ipv4(name)
        if address is not None:
            found.append(address)
    return found + _ipv6()


def _identity(name: str) -> str:
    """Equal for two processes only on one machine: its name, boot and IPC namespace (shared memory)."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        ipc = os.readlink("/proc/self/ns/ipc")
    except OSError:
        ipc = ""
    return f"{name}/{boot}/{ipc}"


def _resolve(name: str) -> tuple[str, ...]:
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return ()
    return tuple(dict.fromkeys(i[4][0].split("%")[0] for i in infos))


def local_card() -> HostCard:
    """This host's card."""
    name = socket.gethostname()
    return HostCard(name, _identity(name), tuple(interfaces()), _resolve(name))


def resolved(name: str) -> str | None:
    """name's first address here that is not loopback, else its first, else None."""
    ips = _resolve(name)
    outward = [ip for ip in ips if not ipaddress.ip_address(ip).is_loopback]
    return (outward or list(ips) or [None])[0]


def route_source(dest: str) -> str | None:
    """The address this host would send from to reach dest (the kernel's route; no packet is sent)."""
    family = socket.AF_INET6 if ":" in dest else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((dest, 9))
            return s.getsockname()[0].split("%")[0]
        except OSError:
            return None


def socket_inodes(pid: int | str = "self") -> set[str]:
    """The inodes of the sockets pid holds open (its /proc fd links); empty where they cannot be read."""
    mine = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                mine.add(target[8:-1])
    except OSError:
        pass
    return mine


def _tcp_links(pid: int) -> list[str]:
    """The local addresses of pid's established TCP connections (IPv4), from /proc."""
    mine = socket_inodes(pid)
    if not mine:
        return []
    found = []
    for line in _read("/proc/net/tcp").splitlines()[1:]:
        fields = line.split()
        if len(fields) > 9 and fields[3] == "01" and fields[9] in mine:  # 01: ESTABLISHED
            found.append(socket.inet_ntoa(struct.pack("<I", int(fields[1].split(":")[0], 16))))
    return found


def _ancestor(names: Sequence[str], depth: int = 6) -> int | None:
    """The PID of this process's nearest ancestor whose command is one of names, else None."""
    pid = os.getpid()
    for _ in range(depth):
        stat = _read(f"/proc/{pid}/stat")
        if not stat:
            return None
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid <= 1:
            return None
        if _read(f"/proc/{pid}/comm") in names:
            return pid
    return None


def daemon_links(daemons: Sequence[str] = ("prted", "prterun")) -> list[str]:
    """The local addresses of the connections held by this process's launcher daemon (Open MPI's
    prted, or prterun on mpirun's own host): its links to the other hosts, made before MPI_Init."""
    pid = _ancestor(daemons)
    return [] if pid is None else _tcp_links(pid)


def daemon_interface(card: HostCard, links: Sequence[str]) -> Address | None:
    """This host's interface that holds most of links (daemon_links), not loopback; None where there
    are none (one host), or this host has one outward IPv4 interface only (nothing to choose)."""
    outward = [a for a in card.outward() if ":" not in a.ip]
    if len(outward) < 2:
        return None
    held = [a for a in outward if a.ip in links]
    return max(held, key=lambda a: links.count(a.ip), default=None)


def hosts_of(cards: Sequence[HostCard]) -> list[int]:
    """Each rank's host number: hosts numbered in order of their first rank."""
    order: dict[str, int] = {}
    return [order.setdefault(card.key, len(order)) for card in cards]


def user_interface(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(variable, interface name) the user chose: SPMD_IFNAME, else GLOO_SOCKET_IFNAME; else None.

    Of a comma-separated GLOO_SOCKET_IFNAME (gloo takes several), the first."""
    for var in ("SPMD_IFNAME", "GLOO_SOCKET_IFNAME"):
        value = (environ.get(var) or "").strip()
        if value:
            return var, value.split(",")[0].strip()
    return None


def _named(card: HostCard, chosen: tuple[str, str]) -> Choice:
    var, name = chosen
    found = [a for a in card.addresses if a.interface == name]
    if not found:
        have = ", ".join(f"{a.interface} ({a.ip})" for a in card.addresses) or "none"
        raise RendezvousError(
            f"{var}={name} names no interface with an address on host {card.name} (its interfaces: {have}); "
            f"set {var} to one of them on every host, or unset it and let spmd choose")
    return Choice(found[0].ip, name, f"{var}={name}")


def _shared(address: Address, me: HostCard, others: Sequence[HostCard], everyone: Sequence[HostCard]) -> int:
    """How many other hosts have an address on address's network (never one another host holds too)."""
    if not address.up or any(a.ip == address.ip for c in everyone if c.key != me.key for a in c.addresses):
        return 0
    net = address.network
    return sum(any(a.ip != address.ip and ipaddress.ip_address(a.ip) in net for a in c.addresses
                   if not a.loopback) for c in others)


def choose_server(me: HostCard, cards: Sequence[HostCard], environ: Mapping[str, str]) -> Choice:
    """The address rank 0 serves on, given every rank's card (its own among them)."""
    chosen = user_interface(environ)
    if chosen is not None:
        return _named(me, chosen)
    others = list({c.key: c for c in cards if c.key != me.key}.values())
    if not others:
        return Choice("127.0.0.1", "lo", "every rank is on this host")
    scored = [(_shared(a, me, others, cards), i, a) for i, a in enumerate(me.outward())]
    scored.sort(key=lambda s: (-s[0], not s[2].up, s[1]))
    if not scored:
        raise RendezvousError(
            f"host {me.name} has no address but loopback, so ranks on {_names(others)} cannot reach it; "
            "give it a network interface, or set SPMD_IFNAME")
    best, _, address = scored[0]
    if best == len(others):
        why = f"on {address.network}, the network every other host ({_names(others)}) has an address on"
    elif best:
        why = f"on {address.network}, shared with {best} of the {len(others)} other hosts (the most of any)"
    else:
        why = f"its first interface up: no other host has an address on any network of {me.name}'s"
    return Choice(address.ip, address.interface, why, best == len(others))


def choose_toward(me: HostCard, target: str, source: str | None, environ: Mapping[str, str],
                  same_host: bool = False) -> Choice:
    """The interface this rank uses toward target (an address of the rendezvous host); source: the
    address the kernel's route to target leaves from (route_source), None when there is no route."""
    chosen = user_interface(environ)
    if chosen is not None:
        return _named(me, chosen)
    if same_host:
        return Choice("127.0.0.1", "lo", "every rank is on this host")
    outward = me.outward()
    try:
        ip = ipaddress.ip_address(target)
    except ValueError:
        ip = None
    if ip is not None and not ip.is_loopback:
        for a in outward:
            if ip in a.network and a.up:
                return Choice(a.ip, a.interface, f"on {a.network}, the network of the rendezvous address {target}")
    if source is not None:
        match = next((a for a in me.addresses if a.ip == source), None)
        if match is not None and not match.loopback:
            return Choice(match.ip, match.interface, f"the route to the rendezvous address {target}")
    up = [a for a in outward if a.up] or outward
    if not up:
        raise RendezvousError(f"host {me.name} has no address but loopback, so no rank on another host can "
                              "reach it; give it a network interface, or set SPMD_IFNAME")
    return Choice(up[0].ip, up[0].interface, f"its first interface up (the route to {target} leaves by "
                  f"{'loopback' if source else 'no interface'})")


def _names(cards: Sequence[HostCard]) -> str:
    names = [c.name for c in cards]
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def loopback_name_note(card: HostCard) -> str | None:
    """Words for a host whose own name resolves to loopback only (Debian's 127.0.1.1), else None."""
    if card.resolves_to and all(ipaddress.ip_address(ip).is_loopback for ip in card.resolves_to):
        return f"{card.name} resolves its own name to {', '.join(card.resolves_to)} (loopback)"
    if not card.resolves_to:
        return f"{card.name} cannot resolve its own name"
    return None


def to_text(card: HostCard) -> str:
    """card as JSON, to go through a store."""
    return json.dumps(asdict(card))


def from_text(text: str | bytes) -> HostCard:
    """The card to_text wrote."""
    fields = json.loads(text)
    fields["addresses"] = tuple(Address(**a) for a in fields["addresses"])
    fields["resolves_to"] = tuple(fields["resolves_to"])
    return HostCard(**fields)


def exchange_over_store(store, rank: int, size: int, card: HostCard) -> list[HostCard]:
    """Every rank's card, through a store (torch's Store interface: set, get)."""
    store.set(f"spmd/card/{rank}", to_text(card))
    return [from_text(store.get(f"spmd/card/{r}")) for r in range(size)]


def host_of_address(ip: str, cards: Sequence[HostCard]) -> str | None:
    """The name of the host that holds ip, else None."""
    holders = {c.name for c in cards for a in c.addresses if a.ip == ip and not a.loopback}
    return next(iter(holders)) if len(holders) == 1 else None
