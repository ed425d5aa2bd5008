"""The other ranks' side of the fail-fast hub: one connection to rank 0's, and a thread that reads it.

A rank acts only on rank 0's exact words on its own connection
(docs/reliability.md, "The hub's protocol"); losing that connection
without a BYE means rank 0 died, and ends this rank too.  With a
heartbeat, the thread says BEAT each interval, and ends this rank when
rank 0 has said nothing for ``judge.MISSES`` intervals (its host is down,
cut off or frozen).
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from spmd.failfast import report
from spmd.failfast.abort import PEER_EXIT
from spmd.failfast.hub import messages
from spmd.failfast.hub.base import Hub, Reply
from spmd.failfast.hub.judge import Silence, silence

__all__ = ["HubClient"]


class HubClient(Hub):
    """A rank's connection to rank 0's hub, authenticated by the job's secret."""

    def __init__(self, rank: int, size: int, share: Callable[[str | None], str], local_only: bool,
                 timeout: float, monitors: Sequence[Any] = (), name: str | None = None, beat: float = 0.0) -> None:
        super().__init__(rank, size, share, local_only, timeout, monitors, name, beat)
        address, hello, self._hub_host = messages.accept_invitation(share(None), rank, self.name)
        self._sock = socket.create_connection(address, timeout=timeout)
        self._sock.settimeout(None)
        self._sock.sendall(hello)
        self._send_lock = threading.Lock()
        self._report = Reply()  # the stacks report rank 0 sends back
        self._failing = False  # this rank said FAIL: it ends with its own status, not the ABORT's
        self._thread = threading.Thread(target=self._watch, name="spmd-hub", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        reader = messages.Reader()
        heart = Silence(self.beat) if self.beat > 0 else None
        if heart is not None:
            heart.heard(0, time.monotonic())
            next_beat = time.monotonic() + self.beat
        while True:
            if heart is not None:
                try:  # look at least twice an interval, so that a late look is this side's own absence
                    ready = select.select([self._sock], [], [], self.beat / 2)[0]
                except (OSError, ValueError):  # closed by close()
                    ready = [self._sock]
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.beat
                    self._send(messages.line(messages.BEAT))
                silent = heart.silent(now)  # acted on only when nothing came
                if not ready:
                    if silent and not self._closing:
                        self._silent(silent)
                        return
                    continue
            try:
                chunk = self._sock.recv(65536)
            except OSError:
                chunk = b""
            if heart is not None:
                heart.heard(0, time.monotonic())
            if not chunk:
                self._verdict.cancel()  # no answer will come: print in full
                self._report.cancel()
                if not self._closing:
                    self._exit(PEER_EXIT, f"### spmd: rank {self.rank}: {self._lost()}; ending")
                return
            for kind, got in reader.feed(chunk):  # a line over MAX_LINE: rank 0 never says one
                if kind is messages.PAYLOAD:
                    self._report.set(got.decode("utf-8", "replace"))
                elif kind is messages.LINE:
                    said = messages.hub_says(got)
                    if said is not None and said[0] == messages.BYE:
                        return
                    if said is not None:
                        self._heard(reader, said)

    def _lost(self) -> str:
        """What this rank says when rank 0's connection closed without a word: its host too, if another."""
        away = self._hub_host and self._hub_host != self.name
        return f"lost rank 0 on {self._hub_host} (it died, or its host did)" if away else "lost rank 0 (it died)"

    def _silent(self, silent: dict[int, float]) -> None:
        """Rank 0 sent no heartbeat for too long: end this rank, naming its host."""
        self._verdict.cancel()
        self._report.cancel()
        hosts = {0: self._hub_host} if self._hub_host else {}
        self._exit(PEER_EXIT, f"### spmd: rank {self.rank}: {silence(silent, hosts)}; ending")

    def _heard(self, reader: messages.Reader, said: tuple) -> None:
        """Act on a message of rank 0's."""
        if said[0] == messages.BEAT:
            return
        if said[0] == messages.ABORT:
            self._closing = True
            if not self._failing:  # the ABORT this rank's own FAIL caused must not win its exit (75)
                self._end(PEER_EXIT)
        elif said[0] == messages.FULL:
            self._verdict.set(self.rank)
        elif said[0] == messages.SAME:
            self._verdict.set(said[1])
        elif said[0] == messages.STACKS:
            data = json.dumps(report.where(self.rank, self.monitors)).encode()
            if len(data) > messages.MAX_STACK:  # cut the threads' part, never the summary
                summary = report.where(self.rank, self.monitors)
                summary["threads"] = summary["threads"][:messages.MAX_STACK // 4] + "\n... (cut)\n"
                data = json.dumps(summary).encode()[:messages.MAX_STACK]
            self._send(messages.framed(messages.STACK, data))
        else:  # REPORT <n>: n bytes of the stacks report follow
            reader.expect(said[1])

    def _send(self, data: bytes) -> bool:
        with self._send_lock:
            try:
                self._sock.sendall(data)
                return True
            except OSError:
                return False

    def _ask_verdict(self, digest: str) -> bool:
        return self._send(messages.line(messages.ERR, digest))

    def _ask_where(self, reason: bytes, wait: float, reply: Reply | None) -> bool:
        if reply is not None:
            self._report = reply
        return self._send(messages.line(messages.WHERE, reason, int(wait * 1000)))

    def fail(self) -> None:
        """Tell every rank that this one failed (it prints its own traceback, then exits with its status)."""
        self._failing = True
        self._send(messages.line(messages.FAIL))

    def close(self) -> None:
        """Leave normally: rank 0 will not take it for a death."""
        self._closing = True
        self._send(messages.line(messages.BYE))
        try:
            self._sock.close()
        except OSError:
            pass
