"""Where the ranks of a torch.distributed world meet: address, port, store.

In order of precedence:

1. ``MASTER_ADDR``/``MASTER_PORT`` from the environment (torchrun, spmd
   run, or the user).  Under ``spmd run`` rank 0 serves the store on the
   socket the launcher already bound (``SPMD_LISTEN_FD``); under torchrun
   the agent's store is joined.
2. An MPI launcher: rank 0 binds a free port and publishes address and
   port with an mpi4py broadcast, so nothing can take the port between
   choosing and using it.
3. A SLURM step: the first host of the step's node list and a port
   derived from the job and step ids in 20000-29999, below Linux's
   ephemeral range; ``SPMD_PORT`` overrides it.

An address that does not resolve is an immediate error naming it.
"""

import os
import socket
import zlib
from datetime import timedelta

from spmd.errors import RendezvousError

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


def _store(addr, port, size, is_master, timeout, listen_fd=None):
    from torch.distributed import TCPStore

    kwargs = {}
    if listen_fd is not None:
        # A listening socket handed over by spmd run; libuv accepts one from torch 2.8.
        kwargs["master_listen_fd"] = listen_fd
        if _torch_version() < (2, 8):
            kwargs["use_libuv"] = False
    return TCPStore(
        addr,
        port,
        size,
        is_master,
        timedelta(seconds=timeout),
        wait_for_workers=False,
        **kwargs,
    )


def _torch_version():
    import torch

    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def _serve(addr, port, size, timeout, listen_fd=None):
    """Start the store's server on rank 0, turning bind errors into RendezvousError."""
    try:
        return _store(addr, port, size, True, timeout, listen_fd)
    except (RuntimeError, OSError) as exc:
        raise _port_in_use(addr, port, exc) from None


def _publish_over_mpi(placement, mpi_comm, timeout, addr=None, port=None):
    """Rank 0 binds and publishes (addr, port) over MPI; return (store, addr, port)."""
    store, error = None, None
    if placement.rank == 0:
        addr = addr or ("127.0.0.1" if placement.num_nodes == 1 else socket.gethostname())
        try:
            store = _serve(addr, port or 0, placement.size, timeout)
            port = store.port
        except RendezvousError as exc:
            error = str(exc)
    addr, port, error = mpi_comm.bcast((addr, port, error), 0)
    if error:
        raise RendezvousError(error)
    check_address(addr, "the rendezvous address published by rank 0")
    if store is None:
        store = _join(addr, port, placement.size, timeout)
    return store, addr, port


def _join(addr, port, size, timeout):
    try:
        return _store(addr, port, size, False, timeout)
    except (RuntimeError, OSError) as exc:
        raise RendezvousError(
            f"could not reach the rendezvous at {addr}:{port} within {timeout:g} s ({exc}); "
            "check that rank 0 started and that the address is reachable from this host"
        ) from None


def rendezvous(placement, settings, mpi_comm=None, environ=None):
    """Return (store, addr, port) for this rank, following the module's precedence.

    settings (spmd.config.settings.Settings) gives the timeout, SPMD_PORT and
    SPMD_LISTEN_FD; environ (default os.environ) torchrun's agent-store variables.
    """
    environ = os.environ if environ is None else environ
    timeout = settings.timeout
    addr, port = placement.master_addr, placement.master_port
    if addr is not None:
        check_address(addr)
    if addr is not None and port is not None:
        if environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            from torch.distributed import PrefixStore

            store = _join(addr, port, placement.size, timeout)
            attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            return PrefixStore(f"spmd/{attempt}", store), addr, port
        if mpi_comm is not None:
            return _publish_over_mpi(placement, mpi_comm, timeout, addr, port)
        if placement.rank == 0:
            return _serve(addr, port, placement.size, timeout, settings.listen_fd), addr, port
        return _join(addr, port, placement.size, timeout), addr, port
    if mpi_comm is not None:
        return _publish_over_mpi(placement, mpi_comm, timeout, addr)
    if placement.launcher == "slurm" and placement.hosts:
        addr = addr or check_address(placement.hosts[0], "the first host of the SLURM node list")
        port = port or settings.port or slurm_port(placement.job_id, placement.step_id)
        if placement.rank == 0:
            return _serve(addr, port, placement.size, timeout), addr, port
        return _join(addr, port, placement.size, timeout), addr, port
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
