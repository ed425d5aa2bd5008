"""The fail-fast hub's messages, written once for both sides (docs/reliability.md, "The hub's protocol").

Every message is one line of at most MAX_LINE bytes; ``STACK <n>`` and
``REPORT <n>`` announce n bytes of payload after their line.  A connection
counts as a rank once its first line is ``HELLO <rank> <secret> [<host>]``:
the secret is checked here, before anything else it says is believed.
``BEAT``, both ways, says only "still here" (the heartbeat).
"""

from __future__ import annotations

import hmac
import re
import secrets
from collections.abc import Iterator

__all__ = [
    "HELLO", "FAIL", "BYE", "ERR", "WHERE", "STACK", "BEAT", "ABORT", "FULL", "SAME", "STACKS", "REPORT",
    "MAX_LINE", "MAX_STACK", "MAX_REPORT", "REASONS", "LINE", "PAYLOAD", "TOO_LONG",
    "Reader", "line", "framed", "verdict", "report", "new_secret", "host_name", "invitation", "accept_invitation",
    "check_hello", "rank_says", "hub_says",
]

# A rank's words (HELLO first, then any of the others) ...
HELLO, FAIL, BYE, ERR, WHERE, STACK = b"HELLO", b"FAIL", b"BYE", b"ERR", b"WHERE", b"STACK"
# ... and rank 0's (BYE too).
ABORT, FULL, SAME, STACKS, REPORT = b"ABORT", b"FULL", b"SAME", b"STACKS", b"REPORT"
# ... and both sides': the heartbeat.
BEAT = b"BEAT"

#: The longest line the hub (or a rank) reads; a longer one closes that connection.
MAX_LINE = 256
#: Bytes of one rank's answer to STACKS, and of the report sent back to a rank that asked, at most.
MAX_STACK = 256 * 1024
MAX_REPORT = 1024 * 1024
#: Why a rank may ask for the stacks report (WHERE <reason> <milliseconds>), as the report says it.
REASONS = {b"timeout": "a call timed out on rank {}", b"signal": "SIGUSR2 on rank {}"}

#: What Reader.feed yields: a whole line, the payload a line announced, a line over MAX_LINE.
LINE, PAYLOAD, TOO_LONG = "line", "payload", "too long"

_HEX = re.compile(rb"[0-9a-f]{1,64}")
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def line(*words: bytes | int | str) -> bytes:
    """One message: the words, separated by spaces, and the newline."""
    return b" ".join(w if isinstance(w, bytes) else str(w).encode() for w in words) + b"\n"


def framed(word: bytes, payload: bytes) -> bytes:
    """A line announcing len(payload) bytes, and the payload."""
    return b"%s %d\n" % (word, len(payload)) + payload


class Reader:
    """Split what one connection receives into lines and the payloads that lines announce.

    The consumer of a line that announces a payload calls expect(n); the
    next n bytes then come whole as one PAYLOAD.
    """

    __slots__ = ("_rest", "_want")

    def __init__(self) -> None:
        self._rest = b""  # the start of a line not yet ended, or of a payload
        self._want: int | None = None  # bytes of the payload still to come

    def expect(self, size: int) -> None:
        """The next size bytes are a payload, not lines."""
        self._want = size

    def feed(self, data: bytes) -> Iterator[tuple[str, bytes]]:
        """Yield (LINE, line), (PAYLOAD, bytes) or (TOO_LONG, b"") for what data completes, in order.

        A line over MAX_LINE, or the start of one, yields TOO_LONG; the start is discarded.
        """
        buf, at = self._rest + data, 0
        self._rest = b""
        while True:
            if self._want is not None:
                if len(buf) - at < self._want:
                    break
                payload, at = buf[at:at + self._want], at + self._want
                self._want = None
                yield PAYLOAD, payload
            else:
                end = buf.find(b"\n", at)
                if end < 0:
                    break
                text, at = buf[at:end], end + 1
                yield (TOO_LONG, b"") if len(text) > MAX_LINE else (LINE, text)
        rest = buf[at:]
        if len(rest) > MAX_LINE and self._want is None:
            yield TOO_LONG, b""
            return
        self._rest = rest


def verdict(rank: int, lead: int) -> bytes:
    """rank 0's answer to rank's ERR: FULL if rank prints it in full, else SAME <lead>."""
    return line(FULL) if lead == rank else line(SAME, lead)


def report(text: str) -> bytes:
    """The stacks report sent back to a rank that asked (at most MAX_REPORT bytes of it)."""
    return framed(REPORT, text.encode("utf-8", "replace")[:MAX_REPORT])


def new_secret() -> bytes:
    """The job's secret: 128 random bits, as hex."""
    return secrets.token_hex(16).encode()


def host_name(name: str | None) -> str | None:
    """name if it can travel in a greeting (a host name of up to 64 letters, digits, '.', '_', '-'), else None."""
    return name if name and _HOST.fullmatch(name) else None


def invitation(host: str, port: int, secret: bytes, name: str | None = None) -> str:
    """What rank 0 shares with the other ranks: where the hub listens, the secret, and rank 0's host name."""
    name = host_name(name)
    return f"{host}:{port} {secret.decode()}" + (f" {name}" if name else "")


def accept_invitation(text: str, rank: int, name: str | None = None) -> tuple[tuple[str, int], bytes, str | None]:
    """Read an invitation: return the hub's (host, port), the greeting rank (on host name) sends it first,
    and rank 0's host name (None if not given)."""
    address, secret, *hub_host = text.split(" ")
    host, port = address.rsplit(":", 1)
    name = host_name(name)
    hello = f"HELLO {rank} {secret}" + (f" {name}" if name else "") + "\n"
    return (host, int(port)), hello.encode(), host_name(hub_host[0]) if hub_host else None


def check_hello(text: bytes, size: int, secret: bytes) -> tuple[int | None, str | None, str | None]:
    """Read a connection's first line: (its rank, its host or None, None), or (None, None, "hello" or "secret":
    what was wrong)."""
    parts = text.split(b" ")
    if (len(parts) not in (3, 4) or parts[0] != HELLO or not parts[1].isdigit() or not 0 < int(parts[1]) < size
            or len(parts) == 4 and not _HOST.fullmatch(parts[3].decode("ascii", "replace"))):
        return None, None, "hello"
    if not hmac.compare_digest(parts[2], secret):
        return None, None, "secret"
    return int(parts[1]), parts[3].decode() if len(parts) == 4 else None, None


def rank_says(text: bytes) -> tuple | None:
    """Read a line of an authenticated rank's: (FAIL,), (BYE,), (BEAT,), (ERR, digest), (WHERE, reason, seconds)
    or (STACK, bytes that follow); None for anything else."""
    if text in (FAIL, BYE, BEAT):
        return (text,)
    parts = text.split(b" ")
    if len(parts) == 2 and parts[0] == ERR and _HEX.fullmatch(parts[1]):
        return ERR, parts[1].decode()
    if len(parts) == 3 and parts[0] == WHERE and parts[1] in REASONS and parts[2].isdigit():
        return WHERE, parts[1], min(int(parts[2]), 60000) / 1000
    if len(parts) == 2 and parts[0] == STACK and parts[1].isdigit() and 0 < int(parts[1]) <= MAX_STACK:
        return STACK, int(parts[1])
    return None


def hub_says(text: bytes) -> tuple | None:
    """Read a line of rank 0's: (ABORT,), (BYE,), (BEAT,), (FULL,), (SAME, rank), (STACKS,) or (REPORT, bytes
    that follow); None for anything else."""
    if text in (ABORT, BYE, BEAT, FULL, STACKS):
        return (text,)
    parts = text.split(b" ")
    if len(parts) == 2 and parts[0] == SAME and parts[1].isdigit():
        return SAME, int(parts[1])
    if len(parts) == 2 and parts[0] == REPORT and parts[1].isdigit() and int(parts[1]) <= MAX_REPORT:
        return REPORT, int(parts[1])
    return None
