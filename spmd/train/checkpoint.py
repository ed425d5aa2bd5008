"""Checkpoints: written atomically by the root, read by the root and broadcast to every rank."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from spmd.util.atomic import atomic_write
from spmd.errors import CheckpointError

if TYPE_CHECKING:
    from spmd.comms.comm import Comm

__all__ = ["atomic_save", "save_checkpoint", "load_checkpoint"]


def _comm(comm: Comm | None) -> Comm:
    if comm is not None:
        return comm
    from spmd import comm as world

    return world


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> str:
    """torch.save obj to path so that path is always either the old file or the new one.

    Writes a temporary file in the same directory, fsyncs it, renames
    it over path with os.replace and fsyncs the directory
    (:mod:`spmd.util.atomic`, which also removes temporaries of dead runs).
    """
    path = os.fspath(path)
    with atomic_write(path) as f:
        torch.save(obj, f)
    return path


def save_checkpoint(obj: Any, path: str | os.PathLike[str], comm: Comm | None = None,
                    root: int = 0) -> str | None:
    """On root, atomic_save obj to path and return path; elsewhere return None."""
    comm = _comm(comm)
    if comm.rank != root:
        return None
    return atomic_save(obj, path)


def load_checkpoint(path: str | os.PathLike[str], comm: Comm | None = None, root: int = 0,
                    weights_only: bool = True) -> Any:
    """Read the checkpoint at path on root and return it on every rank.

    Only root touches the file.  If root cannot read it, root raises
    the original error and every other rank a CheckpointError naming it.
    """
    comm = _comm(comm)
    state, error, failure = None, None, None
    if comm.rank == root:
        try:
            state = torch.load(os.fspath(path), map_location="cpu", weights_only=weights_only)
        except Exception as exc:
            failure, error = exc, f"{type(exc).__name__}: {exc}"
    state, error = comm.broadcast_object((state, error), root)
    if failure is not None:
        raise failure
    if error is not None:
        raise CheckpointError(f"rank {root} could not load checkpoint {os.fspath(path)!r}: {error}")
    return state
