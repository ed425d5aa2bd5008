"""Why the ranks could not meet, in words: a name, an address, a port, a route, or a silence.

Each function turns what the rendezvous met (an OSError, a refused connection, the ranks that
could not join) into a RendezvousError's text that names the cause, the address and how it was
chosen, and the fix.  ``probe_store`` tells a refusal or a missing route (certain within
CERTAIN_WITHIN seconds) from a silence (ANSWER_WITHIN) before a rank waits out the timeout.
"""

import errno
import ipaddress
import socket
import time

from spmd.errors import RendezvousError

__all__ = ["cannot_serve", "unreached", "probe_store", "who_failed", "CERTAIN", "CERTAIN_WITHIN", "ANSWER_WITHIN"]

#: Seconds a rank keeps trying a store that refuses it or has no route, when rank 0 is known to listen.
CERTAIN_WITHIN = 3.0

def cannot_serve(addr, port, exc):
    """The error of a store that cannot listen at addr:port, by its cause: a name, an address, a port."""
    here = socket.gethostname()
    if isinstance(exc, socket.gaierror):
        return RendezvousError(
            f"cannot serve the rendezvous on {addr}: the name {addr!r} does not resolve on {here} ({exc}). "
            "Fix the name (/etc/hosts or DNS), set MASTER_ADDR to an address, or set SPMD_IFNAME to the "
            "interface the other hosts reach")
    if exc.errno == errno.EADDRNOTAVAIL:
        return RendezvousError(
            f"cannot serve the rendezvous on {addr}:{port}: {addr} is not an address of this host ({here}). "
            "Set MASTER_ADDR to an address of rank 0's host, or unset it")
    if exc.errno in (errno.EADDRINUSE, errno.EACCES):
        return RendezvousError(
            f"cannot serve the rendezvous on {addr}:{port}: {exc}. The port is in use (or reserved); "
            "choose another MASTER_PORT (or SPMD_PORT), or unset it and let spmd pick a free one")
    return RendezvousError(f"cannot serve the rendezvous on {addr}:{port} on {here}: {exc}")


CERTAIN = (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH)
#: Seconds a connection to a store known to listen may take: a kernel answers a SYN in milliseconds
#: whatever its process does, so no answer by then is a firewall that drops, or a partition.
ANSWER_WITHIN = 10.0


def probe_store(addr, port, seconds, where):
    """Raise RendezvousError, naming the cause, unless a TCP connection to addr:port opens within seconds
    (retried on a refusal or a missing route for CERTAIN_WITHIN seconds)."""
    started = time.monotonic()
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.1, started + seconds - time.monotonic())).close()
            return
        except socket.timeout:
            raise RendezvousError(
                f"{socket.gethostname()} got no answer from {addr}:{port} (rank 0's rendezvous{f', {where}' if where else ''}) "
                f"within {seconds:g} s, though rank 0 listens there: a firewall that drops packets, or a "
                "partition between the hosts") from None
        except OSError as exc:
            waited = time.monotonic() - started
            if exc.errno not in CERTAIN or waited > CERTAIN_WITHIN:
                raise RendezvousError(unreached(addr, port, exc.errno, exc, where, waited)) from None
        time.sleep(0.2)


def unreached(addr, port, code, exc, where, waited):
    """Why this host could not join the store at addr:port: code, the errno met (None: a loopback
    address published to a rank on another host); where, how the address was chosen."""
    here = socket.gethostname()
    chosen = f" ({where})" if where else ""
    try:
        loop = ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        loop = False
    if loop and code is None:  # published to a rank on another host (a refusal on loopback is a port's)
        return (f"rank 0 serves the rendezvous at {addr}:{port}{chosen}, a loopback address that {here} cannot "
                "reach from another host. Set SPMD_IFNAME (or MASTER_ADDR) to rank 0's interface (or address) "
                "on the network the hosts share, or fix rank 0's host name in /etc/hosts")
    if code == errno.ECONNREFUSED:
        return (f"{here} reached {_with_address(addr)} but port {port} refused the connection "
                f"(waited {waited:.1f} s): "
                f"rank 0 serves the rendezvous at {addr}:{port}{chosen}. A firewall that rejects the port, or "
                "another host holding that address; open the port range (or set SPMD_PORT/MASTER_PORT to an "
                "open port), or set SPMD_IFNAME to the interface the hosts share")
    if code in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return (f"{here} has no route to {addr} (rank 0's rendezvous address{chosen}): {exc}. Set SPMD_IFNAME "
                "to rank 0's interface on the network the hosts share")
    return (f"could not join the rendezvous at {addr}:{port}{chosen} within {waited:.0f} s ({exc}); check that "
            f"rank 0 started and that {addr} is reachable from {here} (a firewall that drops packets, or a "
            "partition), or set SPMD_IFNAME")


def _with_address(addr):
    """addr, and the address it resolves to here when it is a name: 'h1 (198.18.0.11)'."""
    try:
        ipaddress.ip_address(addr.split("%")[0])
        return addr
    except ValueError:
        pass
    try:
        return f"{addr} ({socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0][4][0]})"
    except (OSError, UnicodeError):
        return addr


def who_failed(failed, cards, addr, port, size):
    """One message for the ranks that could not reach rank 0's store: which, on which hosts, and why."""
    by_message = {}
    for rank, message in failed:
        by_message.setdefault(message, []).append(rank)
    host0 = f" on {cards[0].name}" if cards else ""
    lines = [f"{len(failed)} of {size - 1} ranks could not reach rank 0's rendezvous at {addr}:{port}{host0}:"]
    for message, ranks in by_message.items():
        where = sorted({cards[r].name for r in ranks}) if cards else []
        shown = ", ".join(map(str, ranks[:12])) + (" ..." if len(ranks) > 12 else "")
        lines.append(f"  ranks {shown}{' on ' + ', '.join(where) if where else ''}: {message}")
    return "\n".join(lines)


