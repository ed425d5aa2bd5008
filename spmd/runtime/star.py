"""Rank 0 and every other rank, one message at a time, each wait bounded: for checks that must end.

A collective waits for every rank and may route between any two of them; a check of a network
that may be broken cannot.  A :class:`Star` carries JSON-able values only between rank 0 and each
other rank (``share``: rank 0's value to all; ``collect``: every value to rank 0), each call bounded
by its seconds: rank 0 learns who stayed silent (``None`` in its list) and a rank that hears nothing
raises :class:`StarSilence`.  Two carriers: MPI point to point (``MpiStar``; a rank talks with rank 0
only, never through a third) and a key-value store (``StoreStar``; torch's Store interface).
Values are JSON, never pickles: a store may be torchrun's, which anyone who reaches it can write.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

from spmd.errors import RendezvousError

__all__ = ["Star", "MpiStar", "StoreStar", "SoloStar", "StarSilence", "open_star"]


#: Seconds a rank may take to connect to a star rank 0 is known to serve.
JOIN_WITHIN = 5.0


class StarSilence(RendezvousError):
    """Rank 0 said nothing within the bound (it is gone, or unreachable from this rank)."""


class Star:
    """rank, size, and the two bounded calls; subclasses carry the bytes."""

    def __init__(self, rank: int, size: int, carrier: str, met: bool = False) -> None:
        self.rank, self.size, self.carrier = rank, size, carrier
        self.met = met  # every rank is known to have started (a launcher's barrier): no start-up to wait for
        self.gone: set[int] = set()  # rank 0's: ranks silent in a collect, not waited for again
        self.cards: list[Any] | None = None  # rank 0's: every rank's HostCard, when the launcher carried them
        self._round = 0

    def share(self, value: Any, seconds: float) -> Any:
        """Rank 0's value (value elsewhere is ignored), on every rank; StarSilence after seconds."""
        self._round += 1
        if self.rank == 0:
            self._send_all(json.dumps(value).encode())
            return value
        text = self._receive(seconds)
        if text is None:
            raise StarSilence(f"rank {self.rank} heard nothing from rank 0 within {seconds:g} s over "
                              f"{self.carrier}: rank 0 is gone, or this host cannot reach rank 0's")
        return json.loads(text)

    def collect(self, value: Any, seconds: float) -> list[Any] | None:
        """On rank 0 every rank's value in rank order (None for a rank silent for seconds); else None."""
        self._round += 1
        if self.rank != 0:
            self._send_root(json.dumps(value).encode())
            return None
        texts = self._receive_all(seconds)
        self.gone |= {r for r, t in enumerate(texts, 1) if t is None}
        return [value] + [None if t is None else json.loads(t) for t in texts]

    def close(self) -> None:
        """Forget what is still in flight."""

    # -- what a carrier implements -----------------------------------------------------------------

    def _send_all(self, data: bytes) -> None:
        raise NotImplementedError

    def _send_root(self, data: bytes) -> None:
        raise NotImplementedError

    def _receive(self, seconds: float) -> bytes | None:
        raise NotImplementedError

    def _receive_all(self, seconds: float) -> list[bytes | None]:
        """Ranks 1..size-1's message of this round, None where none came within seconds."""
        raise NotImplementedError


def _pause(pause: float) -> float:
    time.sleep(pause)
    return min(2 * pause, 0.02)


class MpiStar(Star):
    """A star over an mpi4py communicator: nonblocking sends, probed receives, one tag per round."""

    TAG = 7300

    def __init__(self, comm: Any) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size(), "MPI")
        self._comm = comm
        self._sent: list[Any] = []  # requests in flight: their buffers must live until done

    def _tag(self) -> int:
        return self.TAG + self._round % 1000

    def _send_all(self, data: bytes) -> None:
        self._sent += [self._comm.isend(data, dest=r, tag=self._tag()) for r in range(1, self.size)]
        self._tidy()

    def _send_root(self, data: bytes) -> None:
        self._sent.append(self._comm.isend(data, dest=0, tag=self._tag()))
        self._tidy()

    def _tidy(self) -> None:
        self._sent = [r for r in self._sent if not r.Test()]

    def _receive(self, seconds: float) -> bytes | None:
        got = self._receive_from([0], seconds)
        return got[0]

    def _receive_all(self, seconds: float) -> list[bytes | None]:
        return self._receive_from(list(range(1, self.size)), seconds)

    def _receive_from(self, sources: list[int], seconds: float) -> list[bytes | None]:
        got: dict[int, bytes] = {}
        deadline, pause = time.monotonic() + seconds, 0.0005
        sources_left = [s for s in sources if s not in self.gone]
        while True:
            for source in sources_left:
                if source not in got:
                    message = self._comm.improbe(source=source, tag=self._tag())
                    if message is not None:
                        got[source] = message.recv()
            if len(got) == len(sources_left) or time.monotonic() > deadline:
                return [got.get(s) for s in sources]
            pause = _pause(pause)

    def close(self) -> None:
        self._tidy()
        self._sent = []


class StoreStar(Star):
    """A star over a store's keys (set, check, get), under prefix."""

    def __init__(self, store: Any, rank: int, size: int, prefix: str = "spmd/star", met: bool = False) -> None:
        where = getattr(store, "address", None)
        super().__init__(rank, size, f"rank 0's store at {where[0]}:{where[1]}" if where else "the rendezvous store",
                         met)
        self._store, self._prefix = store, prefix

    def _key(self, rank: int | None = None) -> str:
        return f"{self._prefix}/{self._round}" + ("" if rank is None else f"/{rank}")

    def _send_all(self, data: bytes) -> None:
        self._store.set(self._key(), data)

    def _send_root(self, data: bytes) -> None:
        try:
            self._store.set(self._key(self.rank), data)
        except Exception as exc:  # noqa: BLE001 - torch's stores raise RuntimeError, spmd's RendezvousError
            raise StarSilence(f"rank {self.rank} could not reach {self.carrier}: {str(exc).splitlines()[0]}") from None

    def _receive(self, seconds: float) -> bytes | None:
        try:
            self._store.wait([self._key()], timedelta(seconds=seconds))
            return self._store.get(self._key())
        except Exception:  # noqa: BLE001 - a timeout, or the store gone: silence either way
            return None

    def close(self) -> None:
        """Rank 0 stops serving its store, if it serves one (every rank must be done with it)."""
        server = getattr(self._store, "server", None)
        if server is not None:
            server.close()

    def _receive_all(self, seconds: float) -> list[bytes | None]:
        keys = [self._key(r) for r in range(1, self.size)]
        waited = [self._key(r) for r in range(1, self.size) if r not in self.gone]
        got: dict[str, bytes] = {}
        deadline, pause = time.monotonic() + seconds, 0.0005
        while True:
            for key in waited:
                try:
                    if key not in got and self._store.check([key]):
                        got[key] = self._store.get(key)
                except Exception:  # noqa: BLE001 - the store gone: the rest stay silent
                    return [got.get(k) for k in keys]
            if len(got) == len(waited) or time.monotonic() > deadline:
                return [got.get(k) for k in keys]
            pause = _pause(pause)


class SoloStar(Star):
    """The star of a world of one: nothing to carry."""

    def __init__(self) -> None:
        super().__init__(0, 1, "nothing")

    def _send_all(self, data: bytes) -> None:
        pass

    def _receive_all(self, seconds: float) -> list[bytes | None]:
        return []


def open_star(placement: Any, environ: Any, seconds: float, prefix: str = "spmd/star") -> Star:
    """The job's star, before MPI starts wherever that can be: under Hydra (MPICH's mpiexec) rank 0 serves a
    store whose address goes round through the launcher's key-value space (``spmd.runtime.pmi``); under
    srun, torchrun or spmd run the rendezvous store; under another MPI launcher MPI's world itself.
    seconds bounds each rank's wait to meet."""
    if placement.size == 1:
        return SoloStar()
    from spmd.runtime.pmi import hydra_pmi

    pmi = hydra_pmi(environ) if placement.is_mpi else None
    if pmi is not None:
        try:
            return _over_hydra(pmi, placement, environ, seconds, prefix)
        finally:
            pmi.close()
    if placement.is_mpi:
        from spmd.runtime import mpiworld

        world = mpiworld.mpi_world(placement, seconds)
        if world is None:
            raise RendezvousError(f"{placement.launcher} started this job, but mpi4py is not importable here: "
                                  "install it (pip install 'spmd[mpi]'), or launch with srun or torchrun")
        return MpiStar(world)
    import os
    from dataclasses import replace

    from spmd.config.settings import Settings
    from spmd.runtime.rendezvous import rendezvous

    settings = Settings.parse(environ, timeout=seconds)
    if settings.listen_fd is not None:  # spmd run's socket: the job's own store serves on it next
        settings = replace(settings, listen_fd=os.dup(settings.listen_fd))
    store, _, _ = rendezvous(placement, settings, None, environ)
    return StoreStar(store, placement.rank, placement.size, prefix)


def _over_hydra(pmi: Any, placement: Any, environ: Any, seconds: float, prefix: str) -> Star:
    """Every rank's card through Hydra's key-value space; rank 0 serves a store where every host reaches it
    (spmd.runtime.network.choose_server) and puts its address; every rank joins it."""
    from spmd.runtime import network, secret
    from spmd.runtime.jobstore import JobStore, StoreServer, bind

    card = network.local_card()
    pmi.put_long(f"spmd-card-{placement.rank}", network.to_text(card))
    pmi.barrier(seconds)
    cards = None
    if placement.rank == 0:
        try:
            cards = [card] + [network.from_text(_said(pmi, f"spmd-card-{r}")) for r in range(1, placement.size)]
            choice = network.choose_server(card, cards, environ)
            key = secret.given(environ) or secret.new()
            server = StoreServer(bind(choice.address, 0, max(placement.size, 128)), key)
            said = [choice.address, server.address[1], key.decode(), None]
        except (RendezvousError, OSError) as exc:
            said = [None, None, None, str(exc)]
        pmi.put_long("spmd-star", json.dumps(said))
    pmi.barrier(seconds)
    address, port, key_text, error = json.loads(_said(pmi, "spmd-star"))
    if error:
        raise RendezvousError(f"rank 0 could not serve the job's star: {error}")
    # rank 0 listens already: a connection that takes longer than JOIN_WITHIN is a network's silence
    store = JobStore((address, port), key_text.encode(), min(seconds, JOIN_WITHIN))
    star = StoreStar(store, placement.rank, placement.size, prefix, met=True)
    if placement.rank == 0:
        store.server = server
        star.cards = cards
    return star


def _said(pmi: Any, key: str) -> str:
    """What a rank put under key before the last barrier; RendezvousError when none did."""
    text = pmi.get_long(key)
    if text is None:
        raise RendezvousError(f"Hydra's key-value space holds no {key} after its barrier")
    return text
