"""Job-wide fail-fast: every rank keeps one authenticated TCP connection to a small hub in rank 0.

A rank that fails says so on its connection; a rank that dies without a
word shows up as its connection closing; either way the hub tells every
rank to exit at once, whatever the launcher.  It also makes one report of
what the ranks say: who prints an error in full, and where every rank is;
with a heartbeat, a host that falls silent ends the job too.
``open_hub(rank, ...)`` starts rank 0's ``HubServer`` or another rank's ``HubClient``
(``messages``: the words; ``judge``: the decisions).  docs/reliability.md,
"The hub's protocol" and "The hub's threat model".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from spmd.failfast.abort import PEER_EXIT
from spmd.failfast.hub.base import Hub, Reply
from spmd.failfast.hub.client import HubClient
from spmd.failfast.hub.judge import WINDOW
from spmd.failfast.hub.messages import MAX_LINE
from spmd.failfast.hub.relay import HubServer
from spmd.failfast.hub.share import hub_share, store_share
from spmd.util.authserver import MAX_PENDING

__all__ = ["open_hub", "Hub", "HubServer", "HubClient", "Reply", "store_share", "hub_share", "PEER_EXIT", "WINDOW",
           "MAX_LINE", "MAX_PENDING"]


def open_hub(rank: int, size: int, share: Callable[[str | None], str], local_only: bool, timeout: float,
             monitors: Sequence[Any] = (), host: str | None = None, name: str | None = None,
             beat: float = 0.0) -> Hub:
    """Start this rank's side of the hub: the server on rank 0, a client elsewhere (Hub's arguments;
    host: an address of rank 0's that the others reach, the rendezvous store's, where the hub listens too)."""
    if rank == 0:
        return HubServer(rank, size, share, local_only, timeout, monitors, host=host, name=name, beat=beat)
    return HubClient(rank, size, share, local_only, timeout, monitors, name=name, beat=beat)
