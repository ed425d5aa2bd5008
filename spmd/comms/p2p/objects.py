"""Objects over point to point: send_object and recv_object (docs/comms.md).

A mixin of :class:`~spmd.comms.p2p.methods.PointToPoint`: an object
travels as its pickle, a uint8 array sent with ``send``.
"""

from __future__ import annotations

import pickle
from typing import Any, Literal, overload

import numpy as np

from spmd.comms.arrays import is_tensor

__all__ = ["ObjectMessages"]


class ObjectMessages:
    """send_object, recv_object."""

    def send_object(self, obj: Any, dst: int, tag: int = 0) -> None:
        """Send a picklable object to rank dst (any size, over 2 GiB included)."""
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        self.send(data, dst, tag)  # type: ignore[attr-defined]

    @overload
    def recv_object(self, src: int | None = None, tag: int = 0, *, status: Literal[False] = False) -> Any: ...
    @overload
    def recv_object(self, src: int | None = None, tag: int = 0, *, status: Literal[True]) -> tuple[Any, int, int]: ...

    def recv_object(self, src: int | None = None, tag: int = 0, *, status: bool = False) -> Any:
        """Receive an object sent with send_object; with ``status=True`` return ``(obj, source, tag)``."""
        data, source, tag = self.recv(src, tag, status=True)  # type: ignore[attr-defined]
        obj = pickle.loads(data.tobytes() if is_tensor(data) else memoryview(data))
        return (obj, source, tag) if status else obj
