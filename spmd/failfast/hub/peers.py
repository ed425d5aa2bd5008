"""The ranks' connections that rank 0's hub has authenticated: the only ones told ABORT or BYE."""

from __future__ import annotations

import socket
import threading

__all__ = ["Peers"]


class Peers:
    """Authenticated sockets and their ranks; written from any thread, one writer at a time."""

    def __init__(self) -> None:
        self._ranks: dict[socket.socket, int] = {}  # (under _lock)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()

    def add(self, conn: socket.socket, rank: int) -> None:
        with self._lock:
            self._ranks[conn] = rank

    def remove(self, conn: socket.socket) -> None:
        with self._lock:
            self._ranks.pop(conn, None)

    def rank_of(self, conn: socket.socket) -> int | None:
        """conn's rank, None if it is not (or no longer) a rank's."""
        return self._ranks.get(conn)

    def tell_all(self, data: bytes) -> None:
        """Send data to every rank that presented the secret."""
        with self._lock:
            peers = list(self._ranks)
        for conn in peers:
            self.write(conn, data)

    def write(self, conn: socket.socket, data: bytes, seconds: float = 1.0) -> None:
        """Send data whole on conn, from any thread, within seconds.

        One writer at a time: the main thread's ABORT (fail) must not land
        inside a REPORT the serve thread is sending on the same socket.
        """
        with self._write_lock:
            try:
                conn.settimeout(seconds)
                conn.sendall(data)
            except OSError:
                pass
            finally:
                try:
                    conn.setblocking(False)  # the serve thread's reads never wait
                except OSError:
                    pass
