"""The job's secret: what proves that a connection to rank 0's store belongs to the job.

In order: ``SPMD_SECRET`` from the environment (``spmd run`` makes one for
its ranks, bin/submit's batch files one per job, a user may set it); under
an MPI launcher, one rank 0 makes and broadcasts with the store's address;
otherwise rank 0 writes a new one to a file that only its user can read,
named for the rendezvous, in ``SPMD_SECRET_DIR`` (default
``~/.cache/spmd/secrets``), and the other ranks read it there: ranks on one
host, or a home directory the nodes share.  Rank 0 removes it at exit.
"""

from __future__ import annotations

import atexit
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path

from spmd.errors import RendezvousError

__all__ = ["ENV", "new", "given", "folder", "publish", "read"]

ENV = "SPMD_SECRET"


def new() -> bytes:
    """A new secret: 128 random bits, as hex."""
    return secrets.token_hex(16).encode()


def given(environ: Mapping[str, str]) -> bytes | None:
    """The secret SPMD_SECRET sets, or None; one too short to guess is refused."""
    text = environ.get(ENV, "").strip()
    if not text:
        return None
    if len(text) < 16:
        raise RendezvousError(f"{ENV} is {len(text)} characters long: use at least 16 random ones, the same in "
                              "every rank (python -c 'import secrets; print(secrets.token_hex(16))')")
    return text.encode()


def folder(environ: Mapping[str, str]) -> Path:
    """Where rank 0 writes the secret when no launcher carries it."""
    if environ.get("SPMD_SECRET_DIR"):
        return Path(environ["SPMD_SECRET_DIR"])
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "spmd" / "secrets"


def publish(name: str, secret: bytes, environ: Mapping[str, str]) -> Path:
    """Write secret where read(name) finds it, readable by this user alone; remove it at exit."""
    where = folder(environ)
    where.mkdir(parents=True, exist_ok=True, mode=0o700)
    if where.stat().st_uid != os.getuid() or where.stat().st_mode & 0o077:
        raise RendezvousError(f"{where} is not private to this user (mode {where.stat().st_mode & 0o777:o}); "
                              f"chmod 700 it, or point SPMD_SECRET_DIR at a folder only you can read")
    path = where / name
    temp = where / f".{name}.{os.getpid()}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    os.replace(temp, path)
    atexit.register(_remove, path, secret)
    return path


def _remove(path: Path, secret: bytes) -> None:
    try:
        if path.read_bytes() == secret:  # not a later job's
            path.unlink()
    except OSError:
        pass


def read(name: str, environ: Mapping[str, str], deadline: float, stale: bytes | None = None) -> bytes:
    """The secret rank 0 published as name (one other than stale), waiting for it until deadline."""
    path = folder(environ) / name
    pause = 0.01
    while True:
        try:
            text = path.read_bytes().strip()
            if text and text != stale:
                return text
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"no secret for this job at {path} within the timeout: rank 0 writes it there when no "
                f"launcher carries one. If rank 0 runs on a host that does not share this folder, set "
                f"{ENV} to the same random value in every rank's environment (bin/submit does), or "
                "SPMD_SECRET_DIR to a shared folder only you can read")
        time.sleep(pause)
        pause = min(2 * pause, 0.2)
