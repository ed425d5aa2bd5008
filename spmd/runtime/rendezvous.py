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

__all__ = ["slurm_port", "check_address", "rendezvous", "await_peers"]

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
            f"{where}={addr!r} does not resolve ({exc}); set MASTER_ADDR to a host name or IP "
            "address that every rank can reach"
        ) from None
    return addr


def _port_in_use(addr, port, exc):
    return RendezvousError(
        f"cannot serve the rendezvous on {addr}:{port}: {exc}. The port is probably in use; "
        "choose another MASTER_PORT (or SPMD_PORT), or unset it and let spmd pick a free one"
    )


def _interface(addr):
    """The address of addr to bind: its first that is not loopback, for ranks on other hosts (Debian
    maps a host's own name to 127.0.1.1), else its first."""
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError:
        return addr
    ips = [info[4][0] for info in infos]
    outward = [ip for ip in ips if not ipaddress.ip_address(ip.split("%")[0]).is_loopback]
    return (outward or ips or [addr])[0]


def _serve(addr, port, size, timeout, key, listen_fd=None):
    """Rank 0: serve the store (on the socket spmd run bound, else on addr's interface) to holders of
    key; return (its client for rank 0, the port)."""
    from spmd.runtime.jobstore import JobStore, StoreServer, bind

    if listen_fd is not None:
        sock = socket.socket(fileno=listen_fd)
    else:
        try:
            sock = bind(_interface(addr), port or 0, max(size, socket.SOMAXCONN))
        except OSError as exc:
            raise _port_in_use(addr, port, exc) from None
    server = StoreServer(sock, key)
    store = JobStore(server.address, key, timeout)
    store.server = server  # lives as long as the store torch holds
    return store, server.address[1]


def _join(addr, port, timeout, key_of):
    """Another rank: the store at addr:port, once it has accepted the key key_of() gives (asked again
    after each refusal: rank 0 may not listen yet, or a file may still hold a former job's key)."""
    from spmd.runtime.jobstore import JobStore

    deadline, pause = time.monotonic() + timeout, 0.01
    while True:
        store = JobStore((addr, port), key_of(deadline), timeout)
        try:
            store.check(["spmd/member"])
            return store
        except RendezvousError as exc:
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"could not join the rendezvous at {addr}:{port} within {timeout:g} s ({exc}); "
                    "check that rank 0 started and that the address is reachable from this host"
                ) from None
        time.sleep(pause)
        pause = min(2 * pause, 0.2)


def _meet_at(placement, addr, port, timeout, environ, name, listen_fd=None):
    """Rank 0 serves at addr:port and the others join, with SPMD_SECRET or one rank 0 writes as name."""
    key = secrets.given(environ)
    if placement.rank == 0:
        if key is None:
            key = secrets.new()
            secrets.publish(name, key, environ)
        return _serve(addr, port, placement.size, timeout, key, listen_fd)[0], addr, port
    key_of = (lambda deadline: key) if key is not None else (lambda deadline: secrets.read(name, environ, deadline))
    return _join(addr, port, timeout, key_of), addr, port


def _publish_over_mpi(placement, mpi_comm, timeout, environ, addr=None, port=None):
    """Rank 0 serves and publishes (address, port, secret) over MPI; return (store, addr, port)."""
    store, error, key = None, None, None
    if placement.rank == 0:
        addr = addr or ("127.0.0.1" if placement.num_nodes == 1 else _interface(socket.gethostname()))
        key = secrets.given(environ) or secrets.new()
        try:
            store, port = _serve(addr, port, placement.size, timeout, key)
        except RendezvousError as exc:
            error = str(exc)
    addr, port, error, key = mpi_comm.bcast((addr, port, error, key), 0)
    if error:
        raise RendezvousError(error)
    check_address(addr, "the rendezvous address published by rank 0")
    if store is None:
        store = _join(addr, port, timeout, lambda deadline: key)
    return store, addr, port


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


def _gloo_on_loopback(placement, environ):
    """Ranks on one host: gloo's own sockets on the loopback interface too (GLOO_SOCKET_IFNAME, unless set)."""
    if placement.num_nodes == 1 and "GLOO_SOCKET_IFNAME" not in environ:
        names = [name for _, name in socket.if_nameindex()]
        if "lo" in names:
            environ["GLOO_SOCKET_IFNAME"] = "lo"


def rendezvous(placement, settings, mpi_comm=None, environ=None):
    """Return (store, addr, port) for this rank, following the module's precedence.

    settings (spmd.config.settings.Settings) gives the timeout, SPMD_PORT and
    SPMD_LISTEN_FD; environ (default os.environ) SPMD_SECRET and torchrun's agent-store variables.
    Ranks on one host also get GLOO_SOCKET_IFNAME=lo in environ, so that gloo listens there alone.
    """
    environ = os.environ if environ is None else environ
    _gloo_on_loopback(placement, environ)
    timeout = settings.timeout
    addr, port = placement.master_addr, placement.master_port
    if addr is not None:
        check_address(addr)
    if addr is not None and port is not None:
        if environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            return _torchrun_store(placement, addr, port, timeout, environ)
        if mpi_comm is not None:
            return _publish_over_mpi(placement, mpi_comm, timeout, environ, addr, port)
        return _meet_at(placement, addr, port, timeout, environ, f"{addr}-{port}", settings.listen_fd)
    if mpi_comm is not None:
        return _publish_over_mpi(placement, mpi_comm, timeout, environ, addr)
    if placement.launcher == "slurm" and placement.hosts:
        addr = addr or check_address(placement.hosts[0], "the first host of the SLURM node list")
        port = port or settings.port or slurm_port(placement.job_id, placement.step_id)
        name = f"slurm-{placement.job_id}.{placement.step_id or 0}"
        return _meet_at(placement, addr, port, timeout, environ, name)
    raise RendezvousError(
        f"no rendezvous for {placement.size} ranks started by {placement.launcher}: set "
        "MASTER_ADDR and MASTER_PORT, or start the job with an MPI launcher (with mpi4py "
        "installed), srun, torchrun or spmd run"
    )


def await_peers(store, rank, size, timeout):
    """Wait until every rank has joined the store, or say how many did."""
    import time

    store.set(f"spmd/arrived/{rank}", "1")
    keys = [f"spmd/arrived/{r}" for r in range(size)]
    deadline = time.monotonic() + timeout
    pause = 0.001
    while not store.check(keys):
        if time.monotonic() > deadline:
            here = [r for r, k in enumerate(keys) if store.check([k])]
            missing = [r for r in range(size) if r not in here]
            raise RendezvousError(
                f"only {len(here)} of {size} ranks arrived within {timeout:g} s; missing ranks "
                f"{missing[:20]}{' ...' if len(missing) > 20 else ''}. Check that every rank was "
                "started (launcher logs), or raise SPMD_TIMEOUT"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.1)
