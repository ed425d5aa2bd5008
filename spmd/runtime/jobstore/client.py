"""A member's side of the job store: a ``torch.distributed.Store`` torch can use like its TCPStore.

Each thread that uses the store gets its own connection, opened with the
answer to the server's challenge; a request waits at most the store's
timeout, and a wait that ran out closes that thread's connection, so a late
answer is never read as the next one's.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from spmd.errors import RendezvousError
from spmd.runtime.jobstore import frames
from spmd.util.authserver import answer

__all__ = ["JobStore"]

_HEAD, _LEN = struct.Struct("!BI"), struct.Struct("!I")


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else bytes(value) if isinstance(value, (bytearray, list)) \
        else str(value).encode()


def _seconds(timeout: Any) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class JobStore(dist.Store):
    """The job's store at address, for a process that knows secret; timeout bounds every wait."""

    def __init__(self, address: tuple[str, int], secret: bytes, timeout: float) -> None:
        super().__init__()
        self.address, self._secret = (address[0], int(address[1])), secret
        self._timeout = float(timeout)
        dist.Store.set_timeout(self, timedelta(seconds=self._timeout))
        self._local = threading.local()

    # -- the connection --------------------------------------------------------------

    def _conn(self, deadline: float) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            return sock
        host, port = self.address
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            greeting = b""
            while not greeting.endswith(b"\n") and len(greeting) < 128:
                chunk = sock.recv(128)
                if not chunk:
                    break
                greeting += chunk
            if not greeting.startswith(frames.GREETING):
                sock.close()
                raise RendezvousError(f"{host}:{port} is not spmd's job store (it said {greeting[:40]!r})")
            sock.sendall(answer(self._secret, greeting[len(frames.GREETING):].strip()))
        except OSError as exc:
            error = RendezvousError(f"could not reach the job store at {host}:{port} ({exc}); check that "
                                    "rank 0 started and that the address is reachable from this host")
            error.errno = exc.errno  # type: ignore[attr-defined]  # refused, unreachable: read by the rendezvous
            raise error from None
        self._local.sock = sock
        return sock

    def _drop(self) -> None:
        sock = getattr(self._local, "sock", None)
        self._local.sock = None
        if sock is not None:
            sock.close()

    def _call(self, op: str, *fields: bytes, timeout: float | None = None) -> list[bytes]:
        seconds = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + seconds
        sock = self._conn(deadline)
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(frames.frame(frames.OPS[op], *fields))
            status, count = _HEAD.unpack(frames.recv_exactly(sock, _HEAD.size))
            out = []
            for _ in range(count):
                (n,) = _LEN.unpack(frames.recv_exactly(sock, _LEN.size))
                out.append(frames.recv_exactly(sock, n))
        except socket.timeout:
            self._drop()
            raise RendezvousError(f"the job store did not answer {op}({_keys(fields)}) within {seconds:g} s: "
                               "a rank that should have set it has not (yet); raise SPMD_TIMEOUT if it is "
                               "only slow") from None
        except (OSError, ConnectionError) as exc:
            self._drop()
            raise RendezvousError(f"the job store at {self.address[0]}:{self.address[1]} closed "
                                  f"({exc}): rank 0 ended or refused this process's answer (a wrong "
                                  "SPMD_SECRET?)") from None
        if status != frames.OK:
            raise RendezvousError(f"the job store refused {op}: {out[0].decode(errors='replace') if out else ''}")
        return out

    # -- dist.Store ------------------------------------------------------------------

    def set(self, key: str, value: Any) -> None:
        self._call("set", _bytes(key), _bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", _bytes(key))[0]

    def add(self, key: str, value: int) -> int:
        return int(self._call("add", _bytes(key), str(int(value)).encode())[0])

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call("compare_set", _bytes(key), _bytes(expected), _bytes(desired))[0]

    def check(self, keys: list[str]) -> bool:
        return self._call("check", *map(_bytes, keys))[0] == b"1"

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self._call("wait", *map(_bytes, keys), timeout=None if timeout is None else _seconds(timeout))

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", _bytes(key))[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call("num_keys")[0])

    def append(self, key: str, value: Any) -> None:
        self._call("append", _bytes(key), _bytes(value))

    def list_keys(self) -> list[str]:
        return [k.decode() for k in self._call("list_keys")]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", *map(_bytes, keys))

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._call("multi_set", *map(_bytes, keys), *map(_bytes, values))

    def set_timeout(self, timeout: Any) -> None:
        self._timeout = _seconds(timeout)
        dist.Store.set_timeout(self, timedelta(seconds=self._timeout))

    def clone(self) -> JobStore:
        return JobStore(self.address, self._secret, self._timeout)


def _keys(fields: tuple[bytes, ...]) -> str:
    return ", ".join(repr(f.decode(errors="replace")) for f in fields[:3]) + (", ..." if len(fields) > 3 else "")
