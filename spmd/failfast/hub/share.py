"""How rank 0's hub tells the other ranks where it is, on the torch backends: through the rendezvous store."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["store_share"]


def store_share(store: Any, rank: int) -> Callable[[str | None], str]:
    """Return a share() for Hub that passes rank 0's value through a store."""

    def share(value):
        if rank == 0:
            store.set("spmd/hub", value)
            return value
        return store.get("spmd/hub").decode()

    return share
