"""Where the ranks of a torch.distributed world meet: address, port, store.

In order of precedence:

1. ``MASTER_ADDR``/``MASTER_PORT`` from the environment (torchrun, spmd
   run, or the user).  Under ``spmd run`` rank 0 serves the store on the
   socket the launcher already bound (``SPMD_LISTEN_FD``); under torchrun
   the agent's store is joined.
2. An MPI launcher: rank 0 binds a free port and publishes address, port
   and the job's secret with an mpi4py broadcast.
3. A SLURM step: the first host of the step's node list and a port
   derived from the job and step ids in 20000-29999, below Linux's
   ephemeral range; ``SPMD_PORT`` overrides it.

Except torchrun's, the store is spmd's own (``spmd.runtime.jobstore``): on one
interface, for holders of the job's secret (``spmd.runtime.secret``).
"""

import ipaddress
import os
import socket
import time
import zlib
from datetime import timedelta

from spmd.errors import RendezvousError
from spmd.runtime import secret as secrets
from spmd.runtime.said_once import SAID_WITHIN, everywhere, said_by_rank_0, said_over_store, say_own
from spmd.runtime.unreachable import (ANSWER_WITHIN, CERTAIN, CERTAIN_WITHIN, cannot_serve, probe_store, unreached,
                                      who_failed)

__all__ = ["slurm_port", "check_address", "rendezvous", "await_peers", "bind_address", "gloo_interface"]

PORT_BASE, PORT_SPAN = 20000, 10000


def slurm_port(job_id, step_id):
    """Return the port for a SLURM step, spread by a hash of job and step id."""
    key = f"{job_id}.{step_id or 0}".encode()
    return PORT_BASE + zlib.crc32(key) % PORT_SPAN


def check_address(addr, where="MASTER_ADDR"):
    """Raise RendezvousError unless addr resolves to an address."""
    try:
        socket.getaddrinfo(addr, None)
    except (socket.gaierror, UnicodeError) as exc:
        raise RendezvousError(
            f"{where}={addr!r} does not resolve on {socket.gethostname()} ({exc}): the name is unknown "
            "there; set MASTER_ADDR to a host name or IP address that every rank can reach, or add the name to "
            "/etc/hosts (or DNS)"
        ) from None
    return addr


_LOCALHOST = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


def _check_given(placement, addr, agent_store):
    """The rendezvous address the user (or a launcher) gave, checked alike on every rank before any rank
    waits for another: a name that does not resolve, or a loopback address for a job on several hosts,
    is a RendezvousError at once, said by rank 0 alone (everywhere)."""
    try:
        check_address(addr)
        if placement.num_nodes > 1 and not agent_store and _loopback_as_given(addr) and not _one_machine(placement):
            hosts = f" ({', '.join(placement.hosts)})" if placement.hosts else ""
            first = f"the first node, {placement.hosts[0]}" if placement.launcher == "slurm" and placement.hosts \
                else "an address every host reaches"
            raise RendezvousError(
                f"MASTER_ADDR={addr} is a loopback address, but this job's {placement.size} ranks run on "
                f"{placement.num_nodes} hosts{hosts}: the ranks on other hosts than rank 0's cannot reach it. "
                f"Unset MASTER_ADDR (spmd then meets at {first}), or set it to the address of rank 0's host on "
                "the network the hosts share")
    except RendezvousError as exc:
        raise everywhere(exc, placement.rank, said_by_rank_0(placement.rank)) from None


def _one_machine(placement):
    """Whether the launcher's nodes are all this machine: every one named by a loopback address as written
    (127.0.0.2, 127.0.0.3, ...: several slurmd on one host, SLURM's multiple-slurmd way), where a loopback
    rendezvous address reaches every rank."""
    return bool(placement.hosts) and all(_loopback_as_given(h) for h in placement.hosts)


def _loopback_as_given(addr):
    """Whether addr is loopback as written (127.0.0.1, ::1, localhost), not a host's name that resolves there."""
    if addr.lower() in _LOCALHOST:
        return True
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


def _interface(addr):
    """The address of addr to bind: its first that is not loopback, for ranks on other hosts (Debian
    maps a host's own name to 127.0.1.1), else its first."""
    infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    ips = [info[4][0] for info in infos]
    outward = [ip for ip in ips if not ipaddress.ip_address(ip.split("%")[0]).is_loopback]
    return (outward or ips or [addr])[0]


def bind_address(addr, placement, environ, card=None):
    """The address rank 0 serves the store on, for a rendezvous at addr (rank 0's host by name or address).

    On one host: addr's own.  Across hosts: addr's first address that is not loopback; when addr
    (typically this host's name) resolves to loopback alone, the interface the user named, else the
    one toward srun's host (SLURM_LAUNCH_NODE_IPADDR), else the first one up: never loopback."""
    from spmd.runtime import network

    try:
        ip = _interface(addr)
    except (OSError, UnicodeError) as exc:
        if not (isinstance(exc, socket.gaierror) and placement.num_nodes > 1 and _own_name(addr)):
            raise cannot_serve(addr, None, exc) if isinstance(exc, OSError) else RendezvousError(str(exc)) from None
        ip = None  # this host cannot resolve its own name: it needs none
    if ip is not None and (placement.num_nodes == 1 or not ipaddress.ip_address(ip.split("%")[0]).is_loopback):
        return ip, None
    card = card or network.local_card()
    toward = (environ.get("SLURM_LAUNCH_NODE_IPADDR") or "").strip()
    source = network.route_source(toward) if toward else None
    choice = network.choose_toward(card, toward or ip or "", source, environ)
    resolves = f"resolves to {ip} (loopback)" if ip else "does not resolve"
    return choice.address, (f"{addr} {resolves} on {card.name}, so rank 0 serves on "
                            f"{choice.address} ({choice.interface}: {choice.why})")


def _own_name(addr):
    """Whether addr is this host's own name (short or full)."""
    here = socket.gethostname()
    return addr.lower() in (here.lower(), here.split(".")[0].lower())


def _serve(addr, port, size, timeout, key, listen_fd=None, bind_ip=None):
    """Rank 0: serve the store (on the socket spmd run bound, else on bind_ip, else on addr's interface)
    to holders of key; return (its client for rank 0, the port)."""
    from spmd.runtime.jobstore import JobStore, StoreServer, bind

    if listen_fd is not None:
        sock = socket.socket(fileno=listen_fd)
    else:
        try:
            sock = bind(bind_ip or _interface(addr), port or 0, max(size, socket.SOMAXCONN))
        except OSError as exc:
            raise cannot_serve(bind_ip or addr, port, exc) from None
    server = StoreServer(sock, key)
    store = JobStore(server.address, key, timeout)
    store.server = server  # lives as long as the store torch holds
    return store, server.address[1]


def _join(addr, port, timeout, key_of, listening=False, where=""):
    """Another rank: the store at addr:port, once it has accepted the key key_of() gives (asked again
    after each refusal: rank 0 may not listen yet, or a file may still hold a former job's key).

    listening: rank 0 already listens (it published the address after binding), so a refusal or a
    missing route is the network's answer, reported within CERTAIN_WITHIN seconds, not the timeout.
    where: words on how the address was chosen, for the error."""
    from spmd.runtime.jobstore import JobStore

    started = time.monotonic()
    deadline, pause = started + timeout, 0.01
    if listening:
        probe_store(addr, port, min(timeout, ANSWER_WITHIN), where)
    last = None  # the last connection's error
    while True:
        try:
            key = key_of(deadline)
        except RendezvousError:
            if last is None:
                raise
            # rank 0 ended (and took its secret file with it) while this rank was refused: say why it was
            raise RendezvousError(unreached(addr, port, getattr(last, "errno", None), last, where,
                                            time.monotonic() - started)) from None
        store = JobStore((addr, port), key, timeout)
        try:
            store.check(["spmd/member"])
            return store
        except RendezvousError as exc:
            last, code = exc, getattr(exc, "errno", None)
            certain = listening and code in CERTAIN and time.monotonic() - started > CERTAIN_WITHIN
            if certain or time.monotonic() > deadline:
                raise RendezvousError(unreached(addr, port, code, exc, where, time.monotonic() - started)) from None
        time.sleep(pause)
        pause = min(2 * pause, 0.2)


def _meet_at(placement, addr, port, timeout, environ, name, listen_fd=None):
    """Rank 0 serves at addr:port and the others join, with SPMD_SECRET or one rank 0 writes as name."""
    key = secrets.given(environ)
    if placement.rank == 0:
        if key is None:
            key = secrets.new()
            secrets.publish(name, key, environ)
        bind_ip = None
        if listen_fd is None:
            bind_ip, _ = bind_address(addr, placement, environ)
        return _serve(addr, port, placement.size, timeout, key, listen_fd, bind_ip)[0], addr, port
    key_of = (lambda deadline: key) if key is not None else (lambda deadline: secrets.read(name, environ, deadline))
    target, why = addr, f"the rendezvous host {addr}"
    if placement.num_nodes > 1 and (_is_loopback(addr) or _own_name(addr) and not _resolves(addr)):
        # addr is this host's own name, resolving to loopback or not at all: rank 0 serves where we would
        target, how = bind_address(addr, placement, environ)
        why = how or why
    return _join(target, port, timeout, key_of, where=why), addr, port


def _publish_over_mpi(placement, mpi_comm, timeout, environ, addr=None, port=None, cards=None):
    """Rank 0 serves and publishes (address, port, secret, why) over MPI; return (store, addr, port).

    cards: every rank's HostCard (exchanged over MPI), from which rank 0 chooses an address every
    other host reaches (spmd.runtime.network.choose_server)."""
    from spmd.runtime import network

    store, error, key, why = None, None, None, ""
    if placement.rank == 0:
        try:
            if addr is not None:
                check_address(addr)
            if addr is None and cards is not None:
                choice = network.choose_server(cards[0], cards, environ)
                addr, why = choice.address, f"{cards[0].name}'s {choice.interface}: {choice.why}"
            elif addr is None:
                addr = "127.0.0.1" if placement.num_nodes == 1 else _interface(socket.gethostname())
            else:
                why = f"MASTER_ADDR={addr}"
            key = secrets.given(environ) or secrets.new()
            store, port = _serve(addr, port, placement.size, timeout, key)
        except (RendezvousError, OSError) as exc:
            error = str(exc)
    addr, port, error, key, why = mpi_comm.bcast((addr, port, error, key, why), 0)
    if error:
        raise everywhere(RendezvousError(error), placement.rank, mpi_comm.Barrier)
    if store is None:
        try:
            check_address(addr, "the rendezvous address published by rank 0")
            if cards is not None and cards[placement.rank].key != cards[0].key and _is_loopback(addr):
                raise RendezvousError(unreached(addr, port, None, "", why, 0.0))
            store = _join(addr, port, timeout, lambda deadline: key, listening=True, where=why)
        except RendezvousError as exc:
            error = str(exc)
    failed = [(r, e) for r, e in enumerate(mpi_comm.allgather(error)) if e]
    if failed:
        server = getattr(store, "server", None)
        if server is not None:
            server.close()
        raise everywhere(RendezvousError(who_failed(failed, cards, addr, port, placement.size)), placement.rank,
                         mpi_comm.Barrier)
    return store, addr, port


def _resolves(addr):
    try:
        socket.getaddrinfo(addr, None)
        return True
    except (OSError, UnicodeError):
        return False


def _is_loopback(addr):
    try:
        return all(ipaddress.ip_address(ip.split("%")[0]).is_loopback for ip in
                   {i[4][0] for i in socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)})
    except (OSError, ValueError):
        return False


def _torchrun_store(placement, addr, port, timeout, environ):
    """The store of torchrun's agent (the launcher's, not spmd's), under a prefix per restart."""
    from torch.distributed import PrefixStore, TCPStore

    try:
        store = TCPStore(addr, port, placement.size, False, timedelta(seconds=timeout))
    except (RuntimeError, OSError) as exc:
        raise RendezvousError(
            f"could not reach torchrun's store at {addr}:{port} within {timeout:g} s ({exc}); "
            "check that torchrun's agent is running"
        ) from None
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"spmd/{attempt}", store), addr, port


def rendezvous(placement, settings, mpi_comm=None, environ=None, cards=None):
    """Return (store, addr, port) for this rank, following the module's precedence.

    settings (spmd.config.settings.Settings) gives the timeout, SPMD_PORT and
    SPMD_LISTEN_FD; environ (default os.environ) SPMD_SECRET and torchrun's agent-store variables;
    cards, under MPI, every rank's HostCard, from which rank 0 chooses the address it publishes.
    """
    environ = os.environ if environ is None else environ
    timeout = settings.timeout
    addr, port = placement.master_addr, placement.master_port
    agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if addr is not None and mpi_comm is None:  # under MPI rank 0 checks it, and says it once
        _check_given(placement, addr, agent_store)
    if addr is not None and port is not None:
        if agent_store:
            return _torchrun_store(placement, addr, port, timeout, environ)
        if mpi_comm is not None:
            return _publish_over_mpi(placement, mpi_comm, timeout, environ, addr, port, cards)
        return _meet_at(placement, addr, port, timeout, environ, f"{addr}-{port}", settings.listen_fd)
    if mpi_comm is not None:
        return _publish_over_mpi(placement, mpi_comm, timeout, environ, addr, cards=cards)
    if placement.launcher == "slurm" and placement.hosts:
        if addr is None and not _own_name(placement.hosts[0]):  # rank 0's host needs no name of its own
            check_address(placement.hosts[0], "the first host of the SLURM node list")
        addr = addr or placement.hosts[0]
        port = port or settings.port or slurm_port(placement.job_id, placement.step_id)
        name = f"slurm-{placement.job_id}.{placement.step_id or 0}"
        return _meet_at(placement, addr, port, timeout, environ, name)
    raise RendezvousError(
        f"no rendezvous for {placement.size} ranks started by {placement.launcher}: set "
        "MASTER_ADDR and MASTER_PORT, or start the job with an MPI launcher (with mpi4py "
        "installed), srun, torchrun or spmd run"
    )


def gloo_interface(placement, addr, environ, card=None, cards=None):
    """Choose this rank's interface and export it as GLOO_SOCKET_IFNAME (gloo reads only the environment),
    unless the user set it; return the Choice.

    With every rank's card: an address of this host on a network every other host has an address on;
    else the interface toward the rendezvous address addr (its network, else the kernel's route)."""
    from spmd.runtime import network

    card = card or network.local_card()
    choice = None
    if cards is not None and placement.num_nodes > 1 and network.user_interface(environ) is None:
        best = network.choose_server(card, cards, environ)
        choice = best if best.reaches_all else None
    if choice is None:
        try:
            target = _interface(addr) if placement.num_nodes > 1 else addr
        except OSError:
            target = addr
        toward = (environ.get("SLURM_LAUNCH_NODE_IPADDR") or "").strip()
        if _is_loopback(target) and toward:  # rank 0's own name: toward srun's host instead
            target = toward
        source = network.route_source(target) if placement.num_nodes > 1 else None
        choice = network.choose_toward(card, target, source, environ, same_host=placement.num_nodes == 1)
    if choice.interface and not (environ.get("GLOO_SOCKET_IFNAME") or "").strip():
        environ["GLOO_SOCKET_IFNAME"] = choice.interface
    return choice


def await_peers(store, rank, size, timeout):
    """Wait until every rank has joined the store, or say how many did and which did not: once, by rank 0,
    when rank 0 came (everywhere: the others wait until it has said it); else by every rank that came."""
    store.set(f"spmd/arrived/{rank}", "1")
    keys = [f"spmd/arrived/{r}" for r in range(size)]
    deadline = time.monotonic() + timeout
    pause = 0.001
    while not store.check(keys):
        if time.monotonic() > deadline:
            here = [r for r, k in enumerate(keys) if store.check([k])]
            missing = [r for r in range(size) if r not in here]
            exc = RendezvousError(
                f"only {len(here)} of {size} ranks arrived within {timeout:g} s; missing ranks "
                f"{missing[:20]}{' ...' if len(missing) > 20 else ''}. Check that every rank was "
                "started (launcher logs) and that its host reaches rank 0's (spmd doctor, launched the same "
                "way, checks every pair of hosts), or raise SPMD_TIMEOUT"
            )
            if 0 in here:  # rank 0 says it, unless the missing came before its own deadline
                raise everywhere(exc, rank, said_over_store(store, rank, SAID_WITHIN, lambda: say_own(rank, exc)))
            raise exc
        time.sleep(pause)
        pause = min(pause * 2, 0.1)
