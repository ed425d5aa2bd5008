"""The launcher's key-value space before MPI starts: Hydra's PMI-1 wire protocol, each call bounded.

MPICH's mpiexec (Hydra, and Intel MPI's) hands each rank a socket to its host's proxy (``PMI_FD``)
and serves a key-value space through it: the channel MPI_Init itself uses to exchange addresses.
It reaches every rank through the launcher's own connections, so it works where two hosts cannot
reach each other, and where MPI_Init, which connects ranks, waits for ever.  ``HydraPmi`` speaks
the protocol's text lines (``cmd=put kvsname=... key=... value=...``, ``cmd=barrier_in``,
``cmd=get ...``) on a duplicate of the socket, so MPI_Init can start on it afterwards.
"""

from __future__ import annotations

import base64
import os
import select
import socket
import time
import zlib
from typing import Mapping

from spmd.errors import RendezvousError

__all__ = ["HydraPmi", "hydra_pmi"]


def hydra_pmi(environ: Mapping[str, str]) -> HydraPmi | None:
    """This rank's PMI-1 connection to Hydra's proxy, or None when Hydra did not start it.

    srun --mpi=pmi2 also sets PMI_FD, for PMI-2, a protocol of other lines: not this one."""
    fd = (environ.get("PMI_FD") or "").strip()
    if not fd.isdigit() or not environ.get("MPI_LOCALNRANKS") or environ.get("PMI_JOBID"):
        return None
    return HydraPmi(int(fd))


class HydraPmi:
    """PMI-1 over the proxy's socket: init, then put, barrier and get in this process's key space."""

    def __init__(self, fd: int) -> None:
        # Blocking, waits bounded by select: a timeout would make the socket non-blocking, and that flag
        # belongs to the descriptor MPICH's own PMI client shares (its PMI_Init then fails).
        self._sock = socket.socket(fileno=os.dup(fd))
        self._sock.setblocking(True)
        self._buf = b""
        got = self._call("cmd=init pmi_version=1 pmi_subversion=1", "response_to_init")
        if got.get("rc") != "0":
            raise RendezvousError(f"Hydra's PMI refused init: {got}")
        self.maxes = self._call("cmd=get_maxes", "maxes")
        self.kvs = self._call("cmd=get_my_kvsname", "my_kvsname")["kvsname"]

    @property
    def value_max(self) -> int:
        """The longest value a put may carry."""
        return int(self.maxes.get("vallen_max", 1024)) - 1

    def put(self, key: str, value: str) -> None:
        """Put key (at most keylen_max characters, no spaces) = value (no spaces)."""
        got = self._call(f"cmd=put kvsname={self.kvs} key={key} value={value}", "put_result")
        if got.get("rc") != "0":
            raise RendezvousError(f"Hydra's PMI refused a put of {key}: {got.get('msg', got)}")

    def barrier(self, seconds: float) -> None:
        """Wait until every rank has come to the barrier: then every put before it can be read."""
        self._call("cmd=barrier_in", "barrier_out", seconds)

    def get(self, key: str) -> str | None:
        """key's value (after a barrier), or None when no rank put it."""
        got = self._call(f"cmd=get kvsname={self.kvs} key={key}", "get_result")
        return got.get("value") if got.get("rc") == "0" else None

    def put_long(self, key: str, text: str) -> None:
        """Put text of any length under key (compressed, split over key, key.1, ... when it must be)."""
        data = base64.b64encode(zlib.compress(text.encode())).decode()
        size = self.value_max
        parts = [data[i:i + size] for i in range(0, len(data), size)] or [""]
        for i, part in enumerate(parts):
            self.put(f"{key}.{i}" if i else key, (str(len(parts)) + ":" + part) if not i else part)

    def get_long(self, key: str) -> str | None:
        """The text put_long put under key (after a barrier), or None when no rank put it."""
        first = self.get(key)
        if first is None:
            return None
        count, data = first.split(":", 1)
        data += "".join(self.get(f"{key}.{i}") or "" for i in range(1, int(count)))
        return zlib.decompress(base64.b64decode(data)).decode()

    def close(self) -> None:
        self._sock.close()

    def _call(self, line: str, answer: str, seconds: float = 10.0) -> dict[str, str]:
        self._sock.sendall(line.encode() + b"\n")
        deadline = time.monotonic() + seconds
        while True:
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RendezvousError(f"Hydra's PMI did not answer {line.split()[0]} within {seconds:g} s: "
                                          "a rank of the job never started, or its host lost mpiexec")
                if not select.select([self._sock], [], [], left)[0]:
                    continue
                chunk = self._sock.recv(65536)
                if not chunk:
                    raise RendezvousError("Hydra's PMI closed its connection: mpiexec is gone")
                self._buf += chunk
            text, self._buf = self._buf.split(b"\n", 1)
            fields = dict(kv.split("=", 1) for kv in text.decode(errors="replace").split() if "=" in kv)
            if fields.get("cmd") == answer:
                return fields
