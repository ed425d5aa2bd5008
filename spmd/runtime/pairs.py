"""Every pair of hosts, checked before gloo connects its full mesh: a partition named, not waited out.

gloo and MPI connect every pair of ranks; when two hosts cannot reach each other (a firewall that
drops, a cut link between two switches), gloo's connectFullMesh waits its whole timeout and names
neither host, and MPICH's MPI_Init waits for ever.  ``check_pairs`` runs first, through a Star
(spmd.runtime.star): the first rank of each host listens on its chosen address, connects to every
other host's (in threads, each bounded by PAIR_WITHIN seconds), and every rank reads the outcome.  The
connections carry no data and need no accept: the kernel's handshake is the answer.  A failed pair
is a RendezvousError on every rank naming each pair, the address and port tried, and the likely cause.
``preflight`` (SPMD_PREFLIGHT=1) runs it before any backend starts, hosts exchanged over the star.
``before_mpi_init`` runs it by default before MPICH's MPI_Init under Hydra across hosts, through the
launcher's key-value space alone (no store, no torch): there MPI_Init would otherwise wait its whole
bound on a partition, and then name no pair.
"""

from __future__ import annotations

import errno
import json
import socket
import sys
import threading
import time
from typing import Any, Sequence

from spmd.errors import RendezvousError
from spmd.runtime.star import Star

__all__ = ["check_pairs", "preflight", "before_mpi_init", "probe", "connect_time", "describe_failures", "PAIR_WITHIN",
           "STARTED_GRACE"]

#: Seconds a connection between two hosts may take: a kernel answers a SYN in milliseconds.
PAIR_WITHIN = 5.0
#: Seconds more than rank 0 the other ranks wait for every rank to start before MPI_Init, so that rank 0,
#: which says why, is the first to give up (Hydra ends the job at the first rank that ends).
STARTED_GRACE = 10.0


def probe(address: str, port: int, seconds: float) -> str | None:
    """None when a TCP connection to address:port opens within seconds, else why not, in words."""
    return connect_time(address, port, seconds)[1]


def connect_time(address: str, port: int, seconds: float) -> tuple[float | None, str | None]:
    """(milliseconds a TCP connection to address:port took to open, None) or (None, why not, in words)."""
    started = time.monotonic()
    try:
        socket.create_connection((address, port), timeout=seconds).close()
        return 1000 * (time.monotonic() - started), None
    except socket.timeout:
        return None, f"no answer within {seconds:g} s: a firewall that drops packets, or a partition"
    except OSError as exc:
        if exc.errno == errno.ECONNREFUSED:
            return None, f"refused after {time.monotonic() - started:.1f} s: a firewall that rejects the port"
        if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return None, f"no route ({exc.strerror}): the hosts share no network on this interface"
        return None, str(exc)


def describe_failures(failures: Sequence[dict[str, Any]], pairs: int) -> str:
    """One message for the pairs of hosts that could not connect."""
    lines = [f"{len(failures)} of {pairs} connections between hosts failed, and a job's ranks must connect every "
             "pair of hosts (gloo's mesh and MPI both do):"]
    for f in failures[:20]:
        lines.append(f"  {f['a']} -> {f['b']}: {f['address']}:{f['port']} ({f['interface']}): {f['error']}")
    if len(failures) > 20:
        lines.append(f"  ... and {len(failures) - 20} more")
    lines.append("Open the hosts' firewalls to each other (TCP, any port), or set SPMD_IFNAME to an interface on a "
                 "network every host shares")
    return "\n".join(lines)


def check_pairs(star: Star, host: int, first_of_host: bool, hosts: int, name: str, address: str,
                interface: str | None, timeout: float) -> None:
    """Check every pair of the job's hosts through star (every rank calls it); raise RendezvousError on
    every rank naming the pairs that could not connect.  host: this rank's host number, of hosts; name,
    address, interface: this host's, as chosen at init."""
    if hosts < 2:
        return
    seconds = min(timeout, PAIR_WITHIN)
    listener = None
    try:
        mine = None
        if first_of_host:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            listener = socket.create_server((address, 0), family=family, backlog=max(hosts, 16))
            mine = [host, name, address, listener.getsockname()[1], interface or "?"]
        got = star.collect(mine, timeout)
        table = star.share(_by_host(got, hosts) if got is not None else None, timeout + seconds)
        failures = _try_all(name, table, host, seconds) if first_of_host else None
        got = star.collect(failures, timeout + seconds)
        failures = star.share([f for fs in got if fs for f in fs] if got is not None else None, 2 * timeout)
    finally:
        if listener is not None:
            listener.close()
    if failures:
        raise RendezvousError(describe_failures(failures, hosts * (hosts - 1)))


def _by_host(said: list[Any], hosts: int) -> list[list[Any] | None]:
    """Each host's [name, address, port, interface] from what the first rank of each said."""
    table: list[list[Any] | None] = [None] * hosts
    for entry in said:
        if entry is not None:
            table[entry[0]] = entry[1:]
    return table


def preflight(placement: Any, environ: Any, timeout: float) -> None:
    """SPMD_PREFLIGHT: before the backend starts (MPI_Init included, which may wait for ever on a broken
    pair), exchange every rank's host over the launcher's star and check every pair of hosts on the
    address spmd would use there; raise RendezvousError, said by rank 0 alone, naming the pairs."""
    from spmd.runtime import network
    from spmd.runtime.star import open_star

    star = open_star(placement, environ, timeout, "spmd/preflight")
    error = None
    try:
        card = network.local_card()
        got = star.collect(network.to_text(card), timeout)
        texts = star.share(got if got is None else [t for t in got], timeout + PAIR_WITHIN)
        if any(t is None for t in texts):
            missing = [r for r, t in enumerate(texts) if t is None]
            raise RendezvousError(f"the pair check heard nothing from ranks {missing[:20]} within {timeout:g} s")
        cards = [network.from_text(t) for t in texts]
        numbers = network.hosts_of(cards)
        first = numbers.index(numbers[placement.rank]) == placement.rank
        address = interface = None
        if first:
            choice = network.choose_server(card, cards, environ)
            address, interface = choice.address, choice.interface
        check_pairs(star, numbers[placement.rank], first, max(numbers) + 1, card.name, address or "127.0.0.1",
                    interface, timeout)
    except (RendezvousError, OSError) as exc:
        error = exc if isinstance(exc, RendezvousError) else RendezvousError(f"the pair check failed: {exc}")
    finally:
        if error is None:
            star.collect(None, timeout)  # every rank is done with the star before rank 0 closes it
            star.close()
    if error is not None:
        from spmd.runtime.said_once import everywhere

        raise everywhere(error, placement.rank, _said_over(star, timeout))


def _said_over(star: Star, timeout: float) -> Any:
    """A said() for said_once.everywhere: rank 0 tells the others once it has spoken, then closes."""
    def said() -> None:
        try:
            star.share(True, timeout)
            star.collect(None, min(timeout, PAIR_WITHIN))
        except RendezvousError:
            pass
        finally:
            star.close()
    return said


def _try_all(name: str, others: list[list[Any] | None], mine: int, seconds: float) -> list[dict[str, Any]]:
    """Connect to every other host's listener at once; return the failures."""
    failures: list[dict[str, Any]] = []
    lock = threading.Lock()

    def one(other: list[Any]) -> None:
        why = probe(other[1], other[2], seconds)
        if why is not None:
            with lock:
                failures.append({"a": name, "b": other[0], "address": other[1], "port": other[2],
                                 "interface": other[3], "error": why})

    threads = [threading.Thread(target=one, args=(o,), daemon=True) for h, o in enumerate(others)
               if h != mine and o is not None]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(failures, key=lambda f: (f["a"], f["b"]))


def before_mpi_init(placement: Any, environ: Any, seconds: float) -> bool:
    """The pair check before MPICH's MPI_Init, through Hydra's key-value space: when Hydra started a job
    that spans several hosts and MPI is not running yet; return whether it ran (and passed).

    Each host's first rank listens on its outward addresses and puts its card; rank 0 chooses each host's
    address (spmd.runtime.network.choose_server) and puts the table; each host's first rank connects to
    every other's; rank 0 reads the failures and puts its verdict.  Four of Hydra's barriers, the first
    bounded by seconds (every rank started), the others by PAIR_WITHIN more.  A broken pair, or a rank
    that never came, is a RendezvousError said by rank 0 alone (said_once.everywhere)."""
    from spmd.runtime.pmi import hydra_pmi

    mpi = sys.modules.get("mpi4py.MPI")
    local = (environ.get("MPI_LOCALNRANKS") or "").strip()
    if mpi is not None and mpi.Is_initialized() or not local.isdigit() or int(local) >= placement.size:
        return False
    pmi = hydra_pmi(environ)
    if pmi is None:
        return False
    try:
        _over_pmi(pmi, placement, environ, seconds)
    except RendezvousError as exc:
        if not hasattr(exc, "everywhere"):
            pmi.close()
        raise
    pmi.close()
    return True


def _over_pmi(pmi: Any, placement: Any, environ: Any, seconds: float) -> None:
    from spmd.runtime import network
    from spmd.runtime.said_once import everywhere

    rank, size = placement.rank, placement.size
    card = network.local_card()
    listeners: dict[str, socket.socket] = {}
    then = min(seconds, PAIR_WITHIN) + PAIR_WITHIN  # every rank has started: a barrier is milliseconds
    try:
        if (environ.get("MPI_LOCALRANKID") or "").strip() == "0":  # this host's first rank
            for a in card.outward():
                try:
                    listeners[a.ip] = socket.create_server(
                        (a.ip, 0), family=socket.AF_INET6 if ":" in a.ip else socket.AF_INET, backlog=128)
                except OSError:
                    pass
        own = [network.to_text(card), bool(listeners), {ip: s.getsockname()[1] for ip, s in listeners.items()}]
        pmi.put_long(f"spmd-pairs-{rank}", json.dumps(own))
        try:
            pmi.barrier(seconds if rank == 0 else seconds + STARTED_GRACE)
        except RendezvousError:
            raise everywhere(RendezvousError(
                f"not every one of the job's {size} ranks started within {seconds:g} s (Hydra's barrier before "
                "MPI_Init): see the launcher's output for a rank that failed to start, or raise SPMD_TIMEOUT"),
                rank, _said_then_end_job(rank)) from None
        if rank == 0:
            try:
                table: dict[str, Any] = {"hosts": _table(pmi, own, size, environ)}
            except (RendezvousError, OSError, ValueError) as exc:
                table = {"error": f"the pair check before MPI_Init: {exc}"}
            pmi.put_long("spmd-pairs", json.dumps(table))
        pmi.barrier(then)
        table = json.loads(pmi.get_long("spmd-pairs") or '{"error": "rank 0 put no table of hosts"}')
        if "error" in table:
            raise everywhere(RendezvousError(table["error"]), rank, _said_over_pmi(pmi, then))
        hosts = table["hosts"]
        mine = next((h for h, entry in enumerate(hosts) if entry[4] == rank), None)
        if mine is not None:
            others = [entry[:4] if entry[1] is not None else None for entry in hosts]
            pmi.put_long(f"spmd-pairs-failed-{rank}", json.dumps(_try_all(card.name, others, mine, PAIR_WITHIN)))
        pmi.barrier(then + PAIR_WITHIN)
    finally:
        for listener in listeners.values():
            listener.close()
    if rank == 0:
        failed = [f for entry in hosts for f in json.loads(pmi.get_long(f"spmd-pairs-failed-{entry[4]}") or "[]")]
        pmi.put_long("spmd-pairs-verdict", describe_failures(failed, len(hosts) * (len(hosts) - 1)) if failed else "")
    pmi.barrier(then)
    verdict = pmi.get_long("spmd-pairs-verdict")
    if verdict:
        raise everywhere(RendezvousError(verdict), rank, _said_over_pmi(pmi, then))


def _table(pmi: Any, own: list[Any], size: int, environ: Any) -> list[list[Any]]:
    """Rank 0: each host's [name, chosen address (None: no listener on it), its port, interface, first
    rank], from what every rank put (own: rank 0's)."""
    from spmd.runtime import network

    said = [own] + [json.loads(pmi.get_long(f"spmd-pairs-{r}") or "null") for r in range(1, size)]
    if any(s is None for s in said):
        raise RendezvousError(f"ranks {[r for r, s in enumerate(said) if s is None][:20]} put no card")
    cards = [network.from_text(s[0]) for s in said]
    numbers = network.hosts_of(cards)
    hosts = []
    for h in range(max(numbers) + 1):
        ranks = [r for r, n in enumerate(numbers) if n == h]
        first = next((r for r in ranks if said[r][1]), ranks[0])
        choice = network.choose_server(cards[first], cards, environ)
        port = said[first][2].get(choice.address)
        hosts.append([cards[first].name, choice.address if port else None, port, choice.interface or "?", first])
    return hosts


def _said_then_end_job(rank: int) -> Any:
    """A said() for a rank that never came: Hydra ends a job at a rank killed, not at one that exits, so
    rank 0, once it has spoken, ends itself by SIGKILL, and with it every rank, the late one included (as
    the watcher of a bounded MPI_Init does); the others wait for that."""
    from spmd.runtime.said_once import QUIET_GRACE

    def said() -> None:
        if rank == 0:
            import os
            import signal

            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(QUIET_GRACE)
    return said


def _said_over_pmi(pmi: Any, seconds: float) -> Any:
    """A said() for said_once.everywhere: rank 0 has spoken once every rank is past one more barrier."""
    def said() -> None:
        try:
            pmi.barrier(seconds)
        except RendezvousError:
            pass
        finally:
            pmi.close()
    return said
