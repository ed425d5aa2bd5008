"""The process-wide communicator: started once by init, ended by finalize.

init reads in one direction: the settings (its arguments and the SPMD_*
variables, parsed once), then the placement (where the launcher put this
rank), then the rendezvous and the backend's communicator, then the guards
that watch it (the hub, the MPI timeout).  What an abort needs to know of
the running communicator is registered with spmd.failfast.abort.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, TypeVar

from spmd.failfast import abort
from spmd.runtime import backends, hints, mpiworld, network, output
from spmd.runtime.pairs import before_mpi_init, check_pairs, preflight
from spmd.runtime.star import StoreStar
from spmd.runtime.rendezvous import gloo_interface
from spmd.runtime.said_once import everywhere, said_over_store
from spmd.failfast.abort import abort_job
from spmd.errors import BackendError, RendezvousError, SettingsError, SpmdError
from spmd.config.placement import detect, regroup
from spmd.config.settings import DEFAULT_TIMEOUT, Settings, parse_timeout

if TYPE_CHECKING:
    from spmd.comms.comm import Comm

_F = TypeVar("_F", bound=Callable[[], object])

__all__ = ["init", "init_watched", "finalize", "initialized", "on_finalize", "abort_job", "DEFAULT_TIMEOUT"]

#: Seconds SPMD_PREFLIGHT's check may wait for every rank to start (at most SPMD_TIMEOUT).
PREFLIGHT_WITHIN = 60.0

_lock = threading.RLock()
_comm = None
_guards = []  # what lives as long as the communicator: watchdogs, the torch group beside MPI
_finalizers = []  # called at every finalize: caches of the communicator that just ended


def _timeout(timeout, environ):
    """Return seconds from the timeout argument, else environ's SPMD_TIMEOUT, else 1800."""
    return parse_timeout(environ, timeout)


def _choose(requested, placement, mpi_world, environ):
    """Return the backend to run, given what was requested and what works."""
    if requested == "auto":
        if placement.launcher != "none" and backends.cuda_usable():
            return "nccl"
        if mpi_world is not None:
            return "mpi"
        return "gloo"
    backends.check_available(requested)
    if requested == "mpi" and mpi_world is None:
        raise BackendError(
            f"backend 'mpi' needs an MPI launcher, but this job was started by "
            f"{placement.launcher}; start it with mpirun (or srun --mpi=pmi2), "
            "or choose the gloo backend"
        )
    return requested


def _nccl_device(placement, store):
    """Bind this rank's GPU, refusing several ranks on one GPU before NCCL starts."""
    import socket

    import torch

    device = backends.cuda_device(placement.local_rank, torch.cuda.device_count())
    torch.cuda.set_device(device)
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    store.set(f"spmd/gpu/{placement.rank}", f"{socket.gethostname()}\n{uuid}")
    bindings = []
    for r in range(placement.size):
        host, gpu = store.get(f"spmd/gpu/{r}").decode().split("\n")
        bindings.append((r, host, gpu))
    error = backends.shared_gpu_error(bindings)
    if error:
        raise BackendError(error)
    return device


def _monitor(settings, nccl):
    from spmd.failfast.calls import Monitor

    return Monitor(settings.debug, settings.trace, nvtx=nccl)


def _start(settings, environ, guarded=True):
    """Start the communicator; return it and the guards that watch it (none when not guarded)."""
    from spmd.comms.comm import Comm
    placement = detect(environ)
    seconds = settings.timeout
    if placement.size == 1:
        from spmd.comms.backends.serial import SerialBackend

        device = "cuda:0" if settings.backend == "nccl" and backends.cuda_usable() else "cpu"
        return Comm(SerialBackend(device, seconds), placement, _monitor(settings, False)), []
    checked = False  # every rank started and every pair of hosts connects, known before MPI_Init
    if settings.preflight and placement.is_mpi:  # before MPI_Init, which waits for ever on a broken pair
        preflight(placement, environ, min(seconds, PREFLIGHT_WITHIN))
    elif settings.preflight is None and placement.is_mpi:  # the same, over Hydra's key-value space alone
        mpiworld.interface_for_mpi(environ)  # a wrong SPMD_IFNAME first, named with this host's interfaces
        checked = before_mpi_init(placement, environ, seconds)
    mpi_world = mpiworld.mpi_world(placement, seconds, checked) if placement.is_mpi else None
    card, cards = network.local_card(), None
    if mpi_world is not None:  # where every rank really runs, before anything depends on it
        cards = mpi_world.allgather(card)
        placement = _placed(placement, cards, "ranks grouped by host over MPI")
    name = _choose(settings.backend, placement, mpi_world, environ)
    monitor = _monitor(settings, name == "nccl")
    torch_mpi = name == "mpi" and "torch" in sys.modules and _torch_has_mpi()
    if name == "mpi" and not torch_mpi:
        from spmd.comms.backends.mpi.backend import MpiBackend
        from spmd.failfast.hub import open_hub
        from spmd.failfast.mpi_timeout import MpiTimeout

        side, placement = _torch_group(settings, placement, mpi_world, environ, card, cards)
        comm = Comm(MpiBackend(mpi_world, seconds), placement, monitor, settings.hierarchy, settings.pipelined)
        timer = MpiTimeout(comm, monitor.family)
        hub = open_hub(placement.rank, placement.size, comm.broadcast_object, placement.num_nodes == 1, seconds,
                       monitor.family, placement.address, card.name, settings.heartbeat)
        mpiworld.release_segments_of(mpi_world)
        return comm, [timer, hub] + side
    from spmd.comms.backends.torchdist.default_group import init_process_group, open_backend
    from spmd.failfast.hub import hub_share, open_hub

    store, device, guards = None, "cpu", []
    if not torch_mpi:  # torch's own MPI group meets through MPI itself
        store, placement = _meet(placement, settings, mpi_world, environ, card, cards, counted=guarded)
    if name == "nccl":
        device = _nccl_device(placement, store)
    init_process_group(name, store, placement.rank, placement.size, seconds, device)
    comm = Comm(open_backend(name, device, timeout=seconds, store=store), placement, monitor, settings.hierarchy, settings.pipelined)
    if store is not None and guarded:
        share, host = hub_share(store, placement.rank, comm.broadcast_object, placement.address)
        guards.append(open_hub(placement.rank, placement.size, share, placement.num_nodes == 1, seconds,
                               monitor.family, host, card.name, settings.heartbeat))
    mpiworld.release_segments_of(mpi_world)
    return comm, guards


def _placed(placement, cards, how):
    """placement with its node and local numbers from every rank's host card."""
    return regroup(placement, network.hosts_of(cards), how, [card.name for card in cards])


class _TorchGroup:
    """torch.distributed's default group that spmd started beside MPI; close destroys it."""

    def __init__(self, store):
        import weakref

        import torch.distributed as dist

        self._store = store  # the rendezvous store: the group holds it too
        self._group = weakref.ref(dist.group.WORLD)  # never the group itself

    def close(self):
        import gc

        import torch.distributed as dist

        # Only spmd's own group: one the user started after destroying it is theirs.
        if dist.is_initialized() and dist.group.WORLD is self._group():
            dist.destroy_process_group()
        # gloo's threads end only once nothing holds the group (see TorchBackend.close): drop the store too, and collect now.
        self._store = None
        gc.collect()


def _torch_group_wanted(settings):
    """Tell whether to start torch.distributed beside MPI, importing torch if asked to."""
    if settings.torch_group is False or (settings.torch_group is None and "torch" not in sys.modules):
        return False
    import torch.distributed as dist

    return dist.is_available() and not dist.is_initialized()  # a group of the user's: left alone


def _torch_group(settings, placement, mpi_world, environ, card, cards):
    """On the mpi backend, start torch.distributed's default group too; return ([its owner] or [], the
    placement with this rank's chosen address)."""
    if not _torch_group_wanted(settings):
        addr = network.choose_server(cards[0], cards, environ).address if placement.num_nodes > 1 else "127.0.0.1"
        return [], _addressed(placement, gloo_interface(placement, addr, environ, card, cards))
    from spmd.comms.backends.torchdist.default_group import init_process_group

    seconds = settings.timeout
    store, placement = _meet(placement, settings, mpi_world, environ, card, cards)  # the address goes over MPI
    name, device = "gloo", "cpu"
    if _nccl_fits(placement, mpi_world):
        name, device = "nccl", _nccl_device(placement, store)
    init_process_group(name, store, placement.rank, placement.size, seconds, device)
    return [_TorchGroup(store)], placement


def _meet(placement, settings, mpi_world, environ, card, cards, counted=True):
    """Rendezvous for a torch group: the store, once every rank has reached it (counted: by
    await_peers, whose error counts who came; a watched rank's parent counts them itself), and the
    placement with its hosts (exchanged through the store when MPI did not) and its chosen address.
    gloo's interface is exported (GLOO_SOCKET_IFNAME) before any group is made."""
    from spmd.runtime.rendezvous import await_peers, rendezvous

    store, addr, _ = rendezvous(placement, settings, mpi_world, environ, cards)
    if counted:
        await_peers(store, placement.rank, placement.size, settings.timeout)
    if cards is None:
        cards = network.exchange_over_store(store, placement.rank, placement.size, card)
        placement = _placed(placement, cards, "ranks grouped by host through the rendezvous store")
    placement = _addressed(placement, gloo_interface(placement, addr, environ, card, cards))
    try:  # before gloo connects every pair of ranks, and waits out a partition
        check_pairs(StoreStar(store, placement.rank, placement.size, "spmd/pairs"), placement.node_rank,
                    placement.local_rank == 0, placement.num_nodes, card.name, placement.address, placement.interface,
                    settings.timeout)
    except RendezvousError as exc:
        raise everywhere(exc, placement.rank, said_over_store(store, placement.rank)) from None
    return store, placement


def _addressed(placement, choice):
    """placement with this rank's address and interface, and why they were chosen."""
    sources = dict(placement.sources, address=choice.why, interface=choice.why)
    return replace(placement, address=choice.address, interface=choice.interface, sources=sources)


def _nccl_fits(placement, mpi_world):
    """Tell whether every rank can bind a GPU of its own for nccl (all ranks agree, over MPI)."""
    fits = False
    if placement.launcher != "none" and backends.cuda_usable():
        import torch

        fits = placement.local_size <= torch.cuda.device_count()
    return all(mpi_world.allgather(fits))


def _register_abort(comm, guards):
    """Tell spmd.failfast.abort this communicator's rank and size, and how its hub warns the others and
    compares their failures; on SIGUSR2, ask the hub where every rank is.  Return the guards."""
    hubs = []
    if guards:
        from spmd.failfast.hub import Hub

        hubs = [guard for guard in guards if isinstance(guard, Hub)]
    abort.register(comm.rank, comm.size, [hub.fail for hub in hubs], hubs[0] if hubs else None)
    if not hubs:
        return guards
    from spmd.failfast.report import SignalReport

    signals = SignalReport(hubs[0].ask_stacks)  # only from the main thread, over no handler of the user's
    return [signals] + guards if signals.installed else guards


def _torch_has_mpi():
    import torch.distributed as dist

    return dist.is_mpi_available()


def init(backend: str | None = None, timeout: float | timedelta | None = None, debug: bool | None = None,
         trace: str | bool | None = None, torch_group: bool | None = None) -> Comm:
    """Start the runtime once and return the global communicator.

    backend: "auto" (default), "gloo", "nccl" or "mpi"; else SPMD_BACKEND.
    timeout: seconds (or a timedelta) that init and each collective may
    wait; else SPMD_TIMEOUT, else 1800.
    debug: compare every collective's fingerprint across ranks first;
    else SPMD_DEBUG.  trace: a path for a Chrome trace of every
    collective, and a summary table at finalize; else SPMD_TRACE.
    torch_group: on the mpi backend (mpi4py), also start torch.distributed's
    default group (gloo, nccl on GPUs), so torch's own code and DDP run:
    None (auto: when torch is imported at init), True (importing torch) or
    False; else SPMD_TORCH_GROUP.  One the user started first is left alone.
    Later calls return the same communicator, and raise if they ask for
    a different backend or timeout.
    """
    global _comm, _guards
    with _lock:
        if _comm is None:
            # torch backs large CPU tensors with transparent huge pages only when
            # asked; without them MPI moves them up to 1.7x slower than numpy's.
            # Read at torch's first large allocation, so this is early enough.
            os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
            # A bad setting fails here, on every rank, before any rank waits for another.
            settings = Settings.parse(os.environ, backend, timeout, debug, trace, torch_group)
            # Each rank's lines whole (and tagged if asked), from here to its exit.
            output.whole_lines(os.environ, settings.tag_output)
            try:
                _comm, _guards = _start(settings, os.environ)
            except SpmdError as exc:
                if getattr(exc, "everywhere", False):
                    abort.report_everywhere(exc)
                raise
            _guards = _register_abort(_comm, _guards)
            _comm._caches.results.configure(settings.keep_results, _comm.local_size)
            if settings.hints:
                hints.at_start(_comm.rank, _comm.local_size)
            if _comm.size > 1:
                _install_excepthook()
                # Nobody leaves init (and perhaps the job) while a peer still joins.
                _comm._backend.barrier()
            _comm._mon.restart()  # the user's first collective is call #1
            atexit.register(finalize)
            return _comm
        if backend not in (None, "auto", _comm.backend) and _comm.size > 1:
            raise BackendError(
                f"spmd is already running on backend {_comm.backend!r}; call spmd.init(backend=...) "
                "before the first use of comm, or spmd.finalize() first"
            )
        if timeout is not None and parse_timeout({}, timeout) != _comm.timeout:
            raise SettingsError(
                f"spmd is already running with a timeout of {_comm.timeout:g} s; call "
                "spmd.init(timeout=...) before the first use of comm, or set SPMD_TIMEOUT"
            )
        return _comm


def init_watched(backend: str | None = None, timeout: float | None = None) -> Comm:
    """Start the global communicator of a rank whose parent watches it (spmd's pytest ranks):
    as init, without the guards (hub, excepthook, finalize at exit) the parent provides."""
    global _comm, _guards
    with _lock:
        if _comm is not None:
            raise SettingsError("init_watched: spmd is already running in this process")
        settings = Settings.parse(os.environ, backend, timeout, None, None, False)
        _comm, _guards = _start(settings, os.environ, guarded=False)
        _comm._caches.results.configure(settings.keep_results, _comm.local_size)
        if _comm.size > 1:
            _comm._backend.barrier()
        _comm._mon.restart()
        return _comm


def _install_excepthook():
    """Make an uncaught exception end the whole job, with this rank's traceback."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt):
            return previous(exc_type, exc, tb)
        abort_job(1, after=abort.report_failure(exc_type, exc, tb))

    sys.excepthook = hook


def on_finalize(fn: _F) -> _F:
    """Call fn() at every finalize, as the communicator ends (the global comm forgets it); return fn."""
    _finalizers.append(fn)
    return fn


def initialized() -> bool:
    """Tell whether init has run (and finalize has not)."""
    return _comm is not None


def finalize() -> None:
    """End the runtime (collective): report the trace, stop the guards, close."""
    global _comm, _guards
    with _lock:
        if _comm is None:
            return
        comm, guards = _comm, _guards
        _comm, _guards = None, []
        abort.unregister()
        for forget in _finalizers:
            forget()
        try:
            _report_trace(comm)
            # Collective, like MPI_Finalize: nobody leaves while a peer still
            # finishes its last collective, and the hub never sees a false death.
            if comm.size > 1:
                comm._backend.barrier()
        finally:
            for guard in guards:
                guard.close()
            comm._close()
            comm._caches.clear()  # every buffer and datatype the communicators kept


def _report_trace(comm):
    """Merge every rank's trace on rank 0, print the table, write the file."""
    mon = comm._mon
    if mon.events is None:
        return
    said = comm._backend.gather_object((comm.placement.host if comm.placement else None, mon.events), 0)
    if comm.rank == 0:
        from spmd.failfast.trace import report

        report(mon.trace, said, comm.size)
