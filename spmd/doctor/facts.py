"""What one rank tells rank 0 of itself: its host's card and the versions it runs, as JSON.

Versions are read from the installed packages' metadata, never by importing them (importing torch
costs seconds): Python, spmd and every package spmd requires, and the MPI library when this process
already started MPI.  ``VERSIONS_THAT_BLOCK`` are those a job cannot mix across ranks.
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

__all__ = ["local_facts", "versions", "VERSIONS_THAT_BLOCK", "card_of"]

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


def _mpi_library(load: bool) -> str | None:
    """The first line of the MPI library's version (loading the library, not starting MPI, when load: MPI
    allows asking before MPI_Init), or why it does not load; None when not asked and not loaded."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None and load:
        try:
            import mpi4py

            mpi4py.rc.initialize, mpi4py.rc.finalize = False, True  # as spmd.runtime.mpiworld does
            from mpi4py import MPI as mpi
        except Exception as exc:  # noqa: BLE001 - a host whose MPI does not load is a finding, not a crash
            return f"none ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if mpi is None:
        return None
    return " ".join(mpi.Get_library_version().strip().splitlines()[0].split())


def versions(mpi: bool = False) -> dict[str, str | None]:
    """Python's version, spmd's, torch's, mpi4py's, the MPI library's (mpi: load it to ask), then every
    other package spmd requires."""
    found: dict[str, str | None] = {"python": platform.python_version(), "spmd": _version("spmd"),
                                    "torch": _version("torch"), "mpi4py": _version("mpi4py"),
                                    "mpi": _mpi_library(mpi)}
    for name in _required():
        if name not in found:
            found[name] = _version(name)
    return found


def local_facts(rank: int, mpi: bool = False) -> dict[str, Any]:
    """This rank's facts: rank, pid, Python executable, versions (mpi: the MPI library's too), its host's card."""
    return {"rank": rank, "pid": os.getpid(), "executable": sys.executable, "versions": versions(mpi),
            "card": asdict(network.local_card())}


def card_of(facts: dict[str, Any]) -> network.HostCard:
    """The HostCard in a rank's facts."""
    return network.from_text(json.dumps(facts["card"]))
