"""The fork server of plain ``pytest``: ``python -m spmd.testing.collected FD ARGS...``.

The controller (the user's pytest, spmd.testing.local) starts it with the
same arguments, in the same directory.  It runs pytest's configuration and
collection as the controller does, so the test modules and what they
import are loaded once, and then, instead of running the tests, serves
the controller's requests on the socket FD: each marked test runs on a kept
world of its size, forked for the first such test and again after one that
did not pass (spmd.testing.watch), and the answer is its ranks' reports.  It writes no
terminal output, junit file or cache of its own: the controller owns them.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from spmd.launch.forkserver.process import die_with, end_now
from spmd.launch.forkserver.safety import probe
from spmd.util import pickled

__all__ = ["main", "Serving", "PRELOAD"]

#: spmd's modules a test's ranks need, imported before forking so that no rank imports them.
PRELOAD = (
    "spmd.runtime.start", "spmd.runtime.rendezvous", "spmd.comms.backends.torchdist.default_group",
    "spmd.comms.backends.torchdist.gloo", "spmd.failfast.calls", "spmd.failfast.report",
    "spmd.comms.api.collectives", "spmd.comms.p2p.methods", "numpy", "torch",
)

#: Plugins of the controller's that must not run here: they would write its files or its terminal.
_SILENCED = ("terminalreporter", "lfplugin", "nfplugin", "stepwiseplugin")


class _Silence:
    """After every plugin's configure: unregister the ones that would write the controller's output."""

    @pytest.hookimpl(trylast=True)
    def pytest_configure(self, config: Any) -> None:
        for name in _SILENCED:
            plugin = config.pluginmanager.get_plugin(name)
            if plugin is not None:
                config.pluginmanager.unregister(plugin)


class Serving:
    """The server's pytest plugin: collect as the controller does, then serve instead of running."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.served = False

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config: Any) -> None:
        config.workerinput = {"workerid": "spmd-server"}  # pytest's word for "write no junit file or cache"
        config.workeroutput = {}
        config.option.xmlpath = None  # the controller writes the junit file
        config.option.usepdb = False  # no terminal here to debug in
        config.option.reportchars = ""


    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: Any) -> bool:
        self.served = True
        serve(session, self.sock)
        return True


def _preload() -> str | None:
    """Import what every rank needs; return why forking would be unsafe now, or None."""
    import importlib

    import threading

    for name in PRELOAD:
        importlib.import_module(name)
    fix = "start it in a fixture instead, which runs in each rank"
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        return (f"the rank server cannot fork ranks: collecting the tests started thread(s) {others} "
                f"(a test module or conftest.py, at import), and forking a process with threads is unsafe; {fix}")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return f"the rank server cannot fork ranks: a test module initialised CUDA at import; {fix}"
    if probe(["the test modules"]) is not None:
        return ("the rank server cannot fork ranks: a forked child could not run a matrix product, most likely "
                "because a test module ran a parallel torch or numpy computation at import (its OpenMP "
                f"threads hang a forked child); {fix}")
    return None


#: Kept worlds at most (one per size and timeout): the least recently used one ends first.
KEPT = 4


def serve(session: Any, sock: socket.socket) -> None:
    """Answer the controller's requests until it closes the socket."""
    from spmd.testing.watch import World

    items = {item.nodeid: item for item in session.items}
    refused = _preload()
    base = Path(session.config._tmp_path_factory.getbasetemp())
    pickled.send(sock, {"ready": True, "pid": os.getpid(), "refused": refused})
    worlds: dict[tuple[int, str, float], World] = {}
    count = 0
    try:
        while True:
            request = pickled.recv(sock)
            if request is None:
                return
            if request["nodeid"] not in items:
                pickled.send(sock, {"error": f"the rank server did not collect {request['nodeid']!r} "
                                          "(its collection differs from this session's)"})
                continue
            if refused:
                pickled.send(sock, {"error": refused})
                continue
            count += 1
            key = (request["size"], request["backend"], request["timeout"])
            world = worlds.pop(key, None)
            if world is not None and not world.alive():
                world.end()
                world = None
            if world is None:
                while len(worlds) >= KEPT:
                    worlds.pop(next(iter(worlds))).end()
                world = World(items, session.config, *key, base / f"w{count}", [sock])
            result, healthy = world.run(request["nodeid"], request.get("next"), base / f"t{count}")
            if healthy:
                worlds[key] = world  # the most recently used last
            else:
                world.end()
            pickled.send(sock, result)
    finally:
        for world in worlds.values():
            world.end()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    controller = os.getppid()
    die_with(controller)
    sock = socket.socket(fileno=int(argv[0]))
    try:  # a test module's `from mpi4py import MPI` must not start MPI here: forked ranks cannot share it
        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
    except ImportError:
        pass
    plugin = Serving(sock)
    code = pytest.main(list(argv[1:]), plugins=[plugin, _Silence()])
    if not plugin.served:
        try:
            pickled.send(sock, {"ready": False, "error": f"the rank server's pytest ended before serving "
                                                      f"(exit status {int(code)}): see its output above"})
        except OSError:
            pass
    end_now(0)


if __name__ == "__main__":
    main()
