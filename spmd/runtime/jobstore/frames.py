"""The job store's frames (requests and answers), written once for both sides.

A connection opens with the server's challenge, ``SPMD-STORE 1 <nonce>``,
and the client's answer, the HMAC-SHA256 of the nonce under the job's
secret (``spmd.util.authserver``'s ``challenge`` and ``answer``); only then
is a frame read.  A frame is a header (an operation or a
status, and how many fields follow) and the fields, each with its length.
"""

from __future__ import annotations

import socket
import struct

__all__ = ["OPS", "OK", "MISSING", "BAD", "MAX_FIELD", "MAX_FIELDS", "GREETING",
           "frame", "Frames", "recv_exactly"]

#: Operations, by the byte that names them on the wire.
OPS = {name: code for code, name in enumerate(
    ("set", "get", "add", "compare_set", "check", "wait", "delete_key", "num_keys", "append", "list_keys",
     "multi_get", "multi_set"), start=1)}
#: Statuses of an answer.
OK, MISSING, BAD = 0, 1, 2
#: Bytes of one field, and fields of one frame, at most (a longer frame closes the connection).
MAX_FIELD = 64 * 1024 * 1024
MAX_FIELDS = 1 << 16
#: The start of the server's challenge (spmd.util.authserver's ``challenge``, with its nonce).
GREETING = b"SPMD-STORE 1 "
_HEAD = struct.Struct("!BI")
_LEN = struct.Struct("!I")


def frame(code: int, *fields: bytes) -> bytes:
    """One request (code: an operation) or answer (code: a status) with its fields."""
    parts = [_HEAD.pack(code, len(fields))]
    for f in fields:
        parts += [_LEN.pack(len(f)), f]
    return b"".join(parts)


class Frames:
    """Split the bytes one connection receives into (code, fields) frames; feed() returns the whole ones."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, list[bytes]]]:
        """Add data; return the frames now complete. Raise OverflowError on a frame over the limits."""
        self._buf += data
        out = []
        while True:
            got = self._parse()
            if got is None:
                return out
            out.append(got)

    def _parse(self) -> tuple[int, list[bytes]] | None:
        buf = self._buf
        if len(buf) < _HEAD.size:
            return None
        code, count = _HEAD.unpack_from(buf)
        if count > MAX_FIELDS:
            raise OverflowError(f"a frame of {count} fields")
        at, fields = _HEAD.size, []
        for _ in range(count):
            if len(buf) < at + _LEN.size:
                return None
            (n,) = _LEN.unpack_from(buf, at)
            if n > MAX_FIELD:
                raise OverflowError(f"a field of {n} bytes")
            at += _LEN.size
            if len(buf) < at + n:
                return None
            fields.append(bytes(buf[at:at + n]))
            at += n
        del buf[:at]
        return code, fields


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """Read n bytes from a blocking socket; raise ConnectionError if it closes first."""
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the job store closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
