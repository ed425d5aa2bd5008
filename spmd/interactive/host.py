"""The host of an interactive session: ``python -m spmd.interactive.host FD CONFIG``.

The front end (spmd.interactive.session, behind the REPL and the notebook
magic) starts it in a session of its own, so a Ctrl-C at the terminal
reaches the front end alone.  It imports torch and spmd's runtime once,
then forks the world's ranks (spmd.interactive.engine) and runs the front
end's requests on them, one at a time: a block on every rank or some, with
a timeout and interrupts; pull, push, restart, stop.  A rank that cannot be
interrupted (blocked inside a collective, which gloo and MPI cannot cancel)
makes the host start the world afresh on as many ranks, saying so; a rank
that dies ends the world until restart.  The host and its ranks die with
the front end (Linux's parent-death signal), so nothing is left behind.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time
from typing import Any

from spmd.interactive.watch import Rank, Watch
from spmd.util import pickled
from spmd.util.words import ranks_text

__all__ = ["Host", "main", "PRELOAD", "START_WITHIN"]

#: Seconds the forked ranks have to start their communicator.
START_WITHIN = 120.0

#: What every rank needs, imported once here before the ranks are forked.
PRELOAD = ("numpy", "torch", "spmd.runtime.start", "spmd.runtime.rendezvous", "spmd.comms.backends.torchdist.default_group",
           "spmd.comms.backends.torchdist.gloo", "spmd.failfast.report", "spmd.interactive.engine")


class Host:
    """The world of size ranks and the requests run on it."""

    def __init__(self, front: socket.socket, size: int, backend: str | None) -> None:
        self.front, self.size, self.backend = front, size, backend
        self.ranks: list[Rank] = []
        self.dead: str | None = None  # why the world has ended, until restart
        self.count = 0
        self.can_restart = True  # forked ranks can be started afresh
        self.fatal = False  # the session cannot go on (a launched world that would need a restart)

    # -- the world -------------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        """Fork the ranks and wait for each to start its communicator."""
        from spmd.launch.supervise import child_env
        from spmd.runtime import secret as job_secret

        began = time.monotonic()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))  # rank 0's store accepts on it: loopback only
        listener.listen(4 * self.size)
        port, host, secret = listener.getsockname()[1], os.getpid(), job_secret.new().decode()
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            for r in range(self.size):
                mine, theirs = pickled.pair()
                pid = os.fork()
                if pid == 0:  # pragma: no cover - the child never returns
                    mine.close()
                    self.front.close()
                    for other in self.ranks:
                        other.sock.close()
                    if r != 0:
                        listener.close()
                    env = child_env(r, self.size, port=port, listen_fd=listener.fileno() if r == 0 else None,
                                    backend=self.backend, prefixed=True, secret=secret)
                    _become(host, env, theirs)
                theirs.close()
                self.ranks.append(Rank(r, pid, mine))
        finally:
            listener.close()
        failed: dict[int, str] = {}
        waiting, deadline = list(self.ranks), time.monotonic() + START_WITHIN
        while waiting and time.monotonic() < deadline:
            for sock in select.select([r.sock for r in waiting], [], [], deadline - time.monotonic())[0]:
                r = next(r for r in waiting if r.sock is sock)
                waiting.remove(r)
                message = pickled.recv(r.sock)
                if message is None or "failed" in message:
                    failed[r.rank] = (message or {}).get("failed", "")
        for r in waiting:
            failed[r.rank] = f"(it had not started its communicator after {START_WITHIN:g} s)"
        if failed:
            self.end()
            first = min(failed)
            self.dead = f"the world did not start ({ranks_text(failed, ranges=True)} failed)"
            return {"error": f"spmd: {self.dead}; rank {first}:\n{failed[first] or '(it exited)'}"}
        self.dead = None
        return {"started": self.size, "seconds": time.monotonic() - began}

    def end(self) -> None:
        """Kill every rank and reap it."""
        for r in self.ranks:
            if not r.gone:
                try:
                    os.kill(r.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for r in self.ranks:
            r.reap()
        self.ranks = []

    def restart(self, why: str | None = None) -> dict[str, Any]:
        self.end()
        reply = self.start()
        if why and "started" in reply:
            reply["note"] = (f"spmd: {why}: the world was started afresh on {self.size} ranks in "
                             f"{reply['seconds']:.1f} s; every rank's variables are gone")
        return reply

    # -- one block -------------------------------------------------------------------

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.dead:
            return {"results": {}, "notes": [f"spmd: {self.dead}; restart the world first (%restart)"]}
        self.count += 1
        targets = self._targets(request.get("ranks"))
        message = {"op": "run", "code": request["code"], "id": self.count, "rich": bool(request.get("rich"))}
        for r in targets:
            pickled.send(r.sock, message)
        return Watch(self, targets, request.get("timeout")).run()

    def _targets(self, ranks: list[int] | None) -> list[Rank]:
        if ranks is None:
            return list(self.ranks)
        return [self.ranks[r] for r in ranks]

    def pull(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.dead:
            return {"error": f"spmd: {self.dead}; restart the world first"}
        values, errors = {}, {}
        targets = self._targets(request.get("ranks"))
        for r in targets:
            pickled.send(r.sock, {"op": "pull", "name": request["name"]})
        for r in targets:
            reply = pickled.recv(r.sock) or {"error": f"rank {r.rank} has gone"}
            if "value" in reply:
                values[r.rank] = reply["value"]
            else:
                errors[r.rank] = reply["error"]
        return {"values": values, "errors": errors}

    def push(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.dead:
            return {"error": f"spmd: {self.dead}; restart the world first"}
        targets = self._targets(request.get("ranks"))
        for r in targets:
            pickled.send(r.sock, {"op": "push", "values": request["values"]})
        for r in targets:
            pickled.recv(r.sock)
        return {"pushed": [r.rank for r in targets]}

    def serve(self) -> None:
        """Answer the front end until it closes its end or says stop."""
        pickled.send(self.front, self.start())
        while True:
            request = pickled.recv(self.front)
            if request is None or request.get("op") == "stop":
                return
            op = request.get("op")
            if op == "run":
                reply = self.run(request)
            elif op == "pull":
                reply = self.pull(request)
            elif op == "push":
                reply = self.push(request)
            elif op == "restart":
                reply = self.restart()
            elif op == "interrupt":  # a late one, after its block had ended
                continue
            else:
                reply = {"error": f"unknown request {op!r}"}
            pickled.send(self.front, reply)


def _become(host: int, env: dict[str, str], sock: socket.socket) -> None:
    """In a forked rank: take its environment, fresh random seeds, and serve (never returns)."""
    from spmd.launch.forkserver.process import die_with
    from spmd.interactive import engine

    die_with(host)
    os.environ.clear()
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # a block's input() must not read the terminal
    os.close(devnull)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    engine.main(sock)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    from spmd.launch.forkserver.process import die_with

    front_end = os.getppid()
    die_with(front_end)
    front = socket.socket(fileno=int(argv[0]))
    config = json.loads(argv[1])
    import importlib

    for name in PRELOAD + tuple(config.get("preload") or ()):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            pickled.send(front, {"error": f"--preload {name}: cannot import it ({exc})"})
            os._exit(1)
    host = Host(front, config["size"], config.get("backend"))
    try:
        host.serve()
    finally:
        host.end()
    os._exit(0)


if __name__ == "__main__":
    main()
