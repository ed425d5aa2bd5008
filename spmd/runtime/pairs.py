"""Every pair of hosts, checked before gloo connects its full mesh: a partition named, not waited out.

gloo connects every pair of ranks; when one pair of hosts cannot reach each other (a firewall that
drops, a cut link between two switches), gloo's connectFullMesh waits its whole timeout and then
names neither host.  ``check_pairs`` runs first, through the rendezvous store: the first rank of each
host listens on its chosen address, the first rank of every host connects to every other host's
listener (in threads, each bounded by PAIR_WITHIN seconds), and every rank reads the outcome.  The
connections carry no data and need no accept: the kernel's handshake is the answer.  A failed pair
is a RendezvousError on every rank naming each pair, the address and port tried, and the likely cause.
"""

from __future__ import annotations

import errno
import json
import socket
import threading
import time
from typing import Any, Sequence

from spmd.errors import RendezvousError

__all__ = ["check_pairs", "probe", "describe_failures", "PAIR_WITHIN"]

#: Seconds a connection between two hosts may take: a kernel answers a SYN in milliseconds.
PAIR_WITHIN = 5.0


def probe(address: str, port: int, seconds: float) -> str | None:
    """None when a TCP connection to address:port opens within seconds, else why not, in words."""
    started = time.monotonic()
    try:
        socket.create_connection((address, port), timeout=seconds).close()
        return None
    except socket.timeout:
        return f"no answer within {seconds:g} s: a firewall that drops packets, or a partition"
    except OSError as exc:
        if exc.errno == errno.ECONNREFUSED:
            return f"refused after {time.monotonic() - started:.1f} s: a firewall that rejects the port"
        if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return f"no route ({exc.strerror}): the hosts share no network on this interface"
        return str(exc)


def describe_failures(failures: Sequence[dict[str, Any]], pairs: int) -> str:
    """One message for the pairs of hosts that could not connect."""
    lines = [f"{len(failures)} of {pairs} connections between hosts failed, so gloo could not connect every "
             "pair of ranks:"]
    for f in failures[:20]:
        lines.append(f"  {f['a']} -> {f['b']}: {f['address']}:{f['port']} ({f['interface']}): {f['error']}")
    if len(failures) > 20:
        lines.append(f"  ... and {len(failures) - 20} more")
    lines.append("Open the hosts' firewalls to each other (TCP, any port), or set SPMD_IFNAME to an interface on a "
                 "network every host shares")
    return "\n".join(lines)


def check_pairs(store: Any, rank: int, host: int, first_of_host: bool, hosts: int, name: str, address: str,
                interface: str | None, timeout: float) -> None:
    """Check every pair of the job's hosts through store (every rank calls it); raise RendezvousError
    naming the pairs that could not connect.  host: this rank's host number, of hosts; name, address,
    interface: this host's, as chosen at init."""
    if hosts < 2:
        return
    seconds = min(timeout, PAIR_WITHIN)
    listener = None
    try:
        if first_of_host:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            listener = socket.create_server((address, 0), family=family, backlog=max(hosts, 16))
            store.set(f"spmd/pairs/at/{host}",
                      json.dumps([name, address, listener.getsockname()[1], interface or "?"]))
            others = [json.loads(store.get(f"spmd/pairs/at/{h}")) for h in range(hosts)]
            failures = _try_all(name, others, host, seconds)
            store.set(f"spmd/pairs/from/{host}", json.dumps(failures))
        failures = [f for h in range(hosts) for f in json.loads(store.get(f"spmd/pairs/from/{h}"))]
    finally:
        if listener is not None:
            listener.close()
    if failures:
        raise RendezvousError(describe_failures(failures, hosts * (hosts - 1)))


def _try_all(name: str, others: list[list[Any]], mine: int, seconds: float) -> list[dict[str, Any]]:
    """Connect to every other host's listener at once; return the failures."""
    failures: list[dict[str, Any]] = []
    lock = threading.Lock()

    def one(other: list[Any]) -> None:
        why = probe(other[1], other[2], seconds)
        if why is not None:
            with lock:
                failures.append({"a": name, "b": other[0], "address": other[1], "port": other[2],
                                 "interface": other[3], "error": why})

    threads = [threading.Thread(target=one, args=(o,), daemon=True) for h, o in enumerate(others) if h != mine]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(failures, key=lambda f: (f["a"], f["b"]))
