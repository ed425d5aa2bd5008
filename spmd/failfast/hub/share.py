"""How rank 0's hub tells the other ranks where it is, on the torch backends: through the job store, or over
the group where the store is torchrun's (which serves anyone who reaches it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["store_share", "hub_share"]


def store_share(store: Any, rank: int) -> Callable[[str | None], str]:
    """Return a share() for Hub that passes rank 0's value through a store."""

    def share(value):
        if rank == 0:
            store.set("spmd/hub", value)
            return value
        return store.get("spmd/hub").decode()

    return share


def hub_share(store: Any, rank: int, broadcast: Callable[..., Any],
              address: str) -> tuple[Callable[[str | None], str], str]:
    """The hub's share() and the address it listens on: the job store's, through the store (spmd's own serves
    only the job's ranks); under torchrun, whose store anyone may read, broadcast (over the group just
    made, as on the mpi backend) and this rank's chosen address."""
    if hasattr(store, "address"):  # spmd's JobStore
        return store_share(store, rank), store.address[0]
    return broadcast, address
