"""What one rank tells rank 0 of itself: its host's card and the versions it runs, as JSON.

Versions are read from the installed packages' metadata, never by importing them (importing torch
costs seconds): Python, spmd and every package spmd requires; and the MPI library's, from the library
itself, wherever mpi4py is installed, under any launcher, without starting MPI (MPI_Get_library_version
may be called before MPI_Init).  ``VERSIONS_THAT_BLOCK`` are those a job cannot mix across ranks.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import platform
import re
import sys
from dataclasses import asdict
from typing import Any

from spmd.runtime import network

__all__ = ["local_facts", "versions", "mpi_library", "VERSIONS_THAT_BLOCK", "card_of"]

#: Versions that must agree on every rank: pickles, tensors' layout and the collectives' wire depend on them.
VERSIONS_THAT_BLOCK = ("python", "torch", "spmd", "mpi4py", "mpi")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _required() -> list[str]:
    """The names of the packages spmd requires (its extras' too), as distributions name them."""
    names = []
    for requirement in metadata.requires("spmd") or ():
        found = re.match(r"[A-Za-z0-9._-]+", requirement)
        if found and found[0].lower() not in names:
            names.append(found[0].lower())
    return names


def mpi_library() -> str | None:
    """The first line of the MPI library's version, asked of the library without starting MPI (MPI allows
    it before MPI_Init); why it does not load ("none (...)"); None where mpi4py is not installed."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        if _version("mpi4py") is None:
            return None
        try:
            import mpi4py

            mpi4py.rc.initialize, mpi4py.rc.finalize = False, True  # as spmd.runtime.mpiworld does
            from mpi4py import MPI as mpi
        except Exception as exc:  # noqa: BLE001 - a host whose MPI does not load is a finding, not a crash
            return f"none ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return " ".join(mpi.Get_library_version().strip().splitlines()[0].split())


def versions() -> dict[str, str | None]:
    """Python's version, spmd's, torch's, mpi4py's, the MPI library's, then every other package spmd
    requires."""
    found: dict[str, str | None] = {"python": platform.python_version(), "spmd": _version("spmd"),
                                    "torch": _version("torch"), "mpi4py": _version("mpi4py"),
                                    "mpi": mpi_library()}
    for name in _required():
        if name not in found:
            found[name] = _version(name)
    return found


def local_facts(rank: int) -> dict[str, Any]:
    """This rank's facts: rank, pid, Python executable, versions, its host's card."""
    return {"rank": rank, "pid": os.getpid(), "executable": sys.executable, "versions": versions(),
            "card": asdict(network.local_card())}


def card_of(facts: dict[str, Any]) -> network.HostCard:
    """The HostCard in a rank's facts."""
    return network.from_text(json.dumps(facts["card"]))
