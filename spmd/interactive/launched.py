"""``python -m spmd.repl`` under a launcher (``mpirun -n 4``, ``srun``): the REPL on a world it did not start.

Every rank starts spmd as a script would, then runs blocks on its main
thread (spmd.interactive.engine).  Rank 0 also holds the host, in a thread,
on a socket that every rank reaches (loopback when the world is on one
host) and that serves only connections that answer the session's secret
(sent over the world's communicator), and the prompt, in another thread,
reading the launcher's stdin.  A Ctrl-C at the terminal reaches the ranks
through the launcher (SIGINT) and interrupts every rank's block.  What a
launched world cannot do is start its ranks afresh: a rank that cannot be
interrupted, or a communicator that failed, ends the session (and the job).
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
import time
from typing import Any

from spmd.interactive.handshake import FRONT, FRONT_SECRET, admit, connect
from spmd.interactive.handshake import WITHIN as CONNECT_WITHIN
from spmd.interactive.host import Host
from spmd.interactive.watch import Rank
from spmd.util import pickled
from spmd.util.words import ranks_text

__all__ = ["LaunchedHost", "main"]


class LaunchedHost(Host):
    """The host of a launched world: its ranks connect to listener and prove they know secret."""

    def __init__(self, front: socket.socket, size: int, listener: socket.socket, secret: bytes) -> None:
        super().__init__(front, size, None)
        self.listener, self.secret = listener, secret
        self.can_restart = False

    def start(self) -> dict[str, Any]:
        began, deadline = time.monotonic(), time.monotonic() + CONNECT_WITHIN
        found: dict[int, socket.socket] = {}
        self.listener.settimeout(1.0)
        while len(found) < self.size and time.monotonic() < deadline:
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            rank = admit(conn, self.secret)
            if rank is None or rank in found or not 0 <= rank < self.size:
                conn.close()
                continue
            found[rank] = conn
        self.listener.close()
        missing = [r for r in range(self.size) if r not in found]
        if missing:
            return {"error": f"spmd: {ranks_text(missing, ranges=True)} did not reach rank 0's host "
                             f"within {CONNECT_WITHIN:g} s"}
        self.ranks = [Rank(r, None, found[r]) for r in range(self.size)]
        for r in self.ranks:
            hello = pickled.recv(r.sock)
            if hello is None or "hello" not in hello:
                return {"error": f"spmd: rank {r.rank} did not start its engine"}
        return {"started": self.size, "seconds": time.monotonic() - began}

    def end(self) -> None:
        """The world has ended (a rank died): the session ends too, once the prompt has said why.

        The connections stay open until rank 0 exits (the launcher then ends
        every rank): an engine whose connection closed would exit at once,
        rank 0's own before its prompt could say anything.
        """
        self.fatal = True

    def restart(self, why: str | None = None) -> dict[str, Any]:
        if why:
            self.fatal = True
            self.dead = f"{why}; a launcher's ranks cannot be started afresh here, so this world ends"
            return {"error": f"spmd: {self.dead}"}
        return {"error": "spmd: a launcher's ranks cannot be started afresh: leave and launch again"}

    def serve(self) -> None:
        super().serve()
        if self.fatal:
            return
        for r in self.ranks:  # the session is over: every engine leaves its loop
            if not r.gone:
                try:
                    pickled.send(r.sock, {"op": "leave"})
                except OSError:
                    pass


def _address(comm: Any) -> str:
    """Rank 0's address that every rank reaches: the one init chose (spmd.runtime.network)."""
    if comm.num_nodes == 1:
        return "127.0.0.1"
    return comm.placement.address


def _prompt(front: socket.socket, size: int, timeout: float | None) -> None:
    """Rank 0's prompt, in a thread: the REPL on the attached host; at its end the session stops."""
    from spmd.interactive.console import Console
    from spmd.interactive.session import Session

    session = Session.attached(front, size, timeout)
    console = Console(session)
    try:
        console.interact(banner=f"spmd repl: {size} launched ranks; every statement runs on every rank, with comm "
                                "and spmd defined. %help lists the commands; Ctrl-D leaves.", exitmsg="")
    finally:
        if console.fatal:
            sys.stdout.flush()
            os._exit(1)  # ranks stuck in a call: the launcher ends the job
        session.stop()


def main(argv: list[str] | None = None) -> None:
    """Every rank of a launched world: start spmd, connect to rank 0's host, run blocks until the session ends."""
    import spmd
    from spmd.interactive.engine import Engine

    import argparse

    parser = argparse.ArgumentParser(prog="python -m spmd.repl", description="The REPL on a launched world.")
    parser.add_argument("--timeout", type=float, default=os.environ.get("SPMD_REPL_TIMEOUT") or None,
                        help="report where every rank is and interrupt a block that runs longer (seconds)")
    timeout = parser.parse_args(sys.argv[1:] if argv is None else argv).timeout
    if timeout is not None and not timeout > 0:
        parser.error(f"--timeout {timeout:g}: give seconds > 0")
    comm = spmd.init()
    if comm.rank == 0:
        listener = socket.create_server((_address(comm), 0), backlog=comm.size)
        secret = secrets.token_bytes(32)
        address = listener.getsockname()[:2]
        comm.broadcast_object((address, secret), 0)
        if os.environ.get(FRONT):  # a notebook's session launched this world: its front end waits there
            where, _, port = os.environ[FRONT].rpartition(":")
            front = connect((where, int(port)), bytes.fromhex(os.environ.get(FRONT_SECRET, "")), -1)
            host = LaunchedHost(front, comm.size, listener, secret)
        else:  # the prompt is here
            front, theirs = pickled.pair()
            host = LaunchedHost(theirs, comm.size, listener, secret)
            threading.Thread(target=_prompt, args=(front, comm.size, timeout), name="spmd-repl-prompt",
                             daemon=True).start()
        threading.Thread(target=host.serve, name="spmd-repl-host", daemon=True).start()
        sock = connect(address, secret, 0)
    else:
        address, secret = comm.broadcast_object(None, 0)
        sock = connect(address, secret, comm.rank)
    engine = Engine(comm, sock)
    engine.send({"hello": os.getpid()})
    engine.serve()
    spmd.finalize()
