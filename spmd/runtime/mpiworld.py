"""MPI's world for spmd.init: the library checked against the launcher before MPI_Init, MPI_Init
bounded by the job's timeout, the world checked, and MPICH's /dev/shm segment released."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

from spmd.config.placement import check_mpi_vendor, check_mpi_world
from spmd.errors import SettingsError
from spmd.runtime.mpishm import release_segments

__all__ = ["mpi_world", "init_mpi_within", "release_segments_of", "interface_for_mpi", "srun_pmi2",
           "PMI2_INIT_WITHIN"]


#: Seconds MPI_Init may take under srun --mpi=pmi2 (at most SPMD_TIMEOUT): there, MPICH's PMI-2 client
#: and Slurm's pmi2 plugin can garble a request and MPI_Init then waits for ever (see PMI2_STUCK).
PMI2_INIT_WITHIN = 120.0
PMI2_STUCK = (
    "MPI_Init under srun --mpi=pmi2 did not complete within {seconds:g} s. A known fault between MPICH's "
    "PMI-2 client and Slurm's pmi2 plugin: MPI's address is put in PMI segments that slurmstepd fails to "
    "parse (srun's output then shows 'mpi/pmi2: value not properly terminated in client request'), and "
    "every rank waits. Ways round: SPMD_IFNAME=<the interface the nodes share> (spmd passes it to UCX as "
    "UCX_NET_DEVICES, and MPI's address fits one PMI value), or SPMD_BACKEND=gloo under plain srun, or "
    "mpirun inside the allocation")


def srun_pmi2(environ):
    """Whether srun --mpi=pmi2 started this process (Slurm's pmi2 plugin sets PMI_JOBID; Hydra does not,
    and sets MPI_LOCALNRANKS, which Slurm does not)."""
    return bool(environ.get("PMI_JOBID")) and not environ.get("MPI_LOCALNRANKS") and bool(environ.get("PMI_FD"))


def init_mpi_within(MPI, placement, seconds, stuck=None):
    """MPI_Init, which waits for every rank: end the job if one never comes.

    MPI_Init holds the GIL, so no Python thread can watch it; a forked child
    does, and kills this process (and so, through the launcher, the job) when the time is up,
    saying stuck (formatted with seconds) if given, rank 0 alone (every rank is stuck alike), else
    on each rank that not every rank started.
    """
    parent = os.getpid()
    child = os.fork()
    if child == 0:  # the watcher: wait, then speak and end the parent
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.2)
            if os.getppid() != parent:  # the parent is gone: never kill a reused pid
                os._exit(0)
        why = stuck.format(seconds=seconds) if stuck else (
            f"MPI_Init did not complete within {seconds:g} s: not all {placement.size} ranks started "
            "(see the launcher's output), or two of the hosts cannot reach each other (MPI_Init connects "
            "them): launch python -m spmd.doctor the same way, or set SPMD_PREFLIGHT=1, to name the pair; "
            "else raise SPMD_TIMEOUT")
        if not stuck or placement.rank == 0:  # every rank is stuck alike: rank 0 says why
            os.write(2, f"### spmd: rank {placement.rank}: {why}\n".encode())
        os.kill(parent, signal.SIGKILL)
        os._exit(0)
    try:
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def interface_for_mpi(environ, launcher=None):
    """SPMD_IFNAME, told to the MPI library too before MPI_Init, unless the user told it already:
    Open MPI's TCP transport (OMPI_MCA_btl_tcp_if_include) and UCX's network devices
    (UCX_NET_DEVICES, the MPICH wheel's).  On hosts with several interfaces, one of them holding
    an address every host has (docker0's), Open MPI's TCP transport otherwise mixes up peers; so
    under Open MPI without SPMD_IFNAME, its TCP transport is given the interface that Open MPI's own
    daemon on this host reached the other hosts by (spmd.runtime.network.daemon_interface)."""
    name = (environ.get("SPMD_IFNAME") or "").strip()
    if name and name not in {n for _, n in socket.if_nameindex()}:  # before MPI_Init fails on it, unexplained
        from spmd.runtime.network import local_card

        card = local_card()
        have = ", ".join(f"{a.interface} ({a.ip})" for a in card.addresses) or "none"
        raise SettingsError(f"SPMD_IFNAME={name} names no interface of host {card.name} (its interfaces: {have}); "
                            "set SPMD_IFNAME to one of them on every host, or unset it and let spmd choose")
    if name:
        environ.setdefault("OMPI_MCA_btl_tcp_if_include", name)
        environ.setdefault("UCX_NET_DEVICES", name)
        return
    told = ("OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_btl_tcp_if_exclude")
    if launcher != "openmpi" or any((environ.get(var) or "").strip() for var in told):
        return
    from spmd.runtime.network import daemon_interface, daemon_links, local_card

    found = daemon_interface(local_card(), daemon_links())
    if found is not None:
        environ["OMPI_MCA_btl_tcp_if_include"] = found.interface


#: Why MPI_Init did not complete where the pair check before it passed (every rank started, every pair
#: of hosts connects on spmd's address): MPI's own transport, on another interface or port.
STUCK_AFTER_CHECK = (
    "MPI_Init did not complete within {seconds:g} s, though every rank started and every pair of hosts "
    "connects on the addresses spmd chose (checked before MPI_Init): MPI's own transport cannot connect, on "
    "another interface or ports a firewall blocks. Set SPMD_IFNAME to the interface the hosts share (spmd "
    "passes it to UCX and Open MPI), open the hosts' firewalls to each other, or raise SPMD_TIMEOUT")


def mpi_world(placement, seconds, checked=False):
    """Return MPI.COMM_WORLD if mpi4py is importable and agrees with the launcher.

    checked: the pair check before MPI_Init passed (spmd.runtime.pairs.before_mpi_init), so a bounded
    MPI_Init that runs out is MPI's own transport, said by rank 0 alone."""
    try:
        import mpi4py
    except ImportError:
        return None
    if "mpi4py.MPI" not in sys.modules:
        # Look at the library before MPI_Init, which aborts under a foreign launcher.
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = True
    from mpi4py import MPI

    if not MPI.Is_initialized():
        check_mpi_vendor(placement, MPI.get_vendor()[0], MPI.Get_library_version())
        interface_for_mpi(os.environ, placement.launcher)
        if srun_pmi2(os.environ):
            init_mpi_within(MPI, placement, min(seconds, PMI2_INIT_WITHIN), PMI2_STUCK)
        else:
            init_mpi_within(MPI, placement, seconds, STUCK_AFTER_CHECK if checked else None)
    world = MPI.COMM_WORLD
    check_mpi_world(placement, world.Get_rank(), world.Get_size(), MPI.Get_library_version())
    return world


def release_segments_of(mpi_world):
    """Collective: once the communicator stands, MPICH's /dev/shm segment loses its name, so that no
    failure of the job can leave it behind.  Every rank calls it at the same point of _start, whoever
    called MPI_Init: a rank whose script imported mpi4py.MPI first must not skip a barrier the others
    wait in, and no rank waits in it before rank 0 serves the store (a peer may start late)."""
    if mpi_world is not None:
        from mpi4py import MPI

        release_segments(MPI, mpi_world)
