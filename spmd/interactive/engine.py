"""One rank of an interactive session: run each block the host sends, in one namespace kept between blocks.

The host (spmd.interactive.host) forks this rank and talks to it over a
socket pair.  A block runs on the main thread with its printed output
captured, its last expression's value kept (as text, and as a notebook's
rich formats when asked) and its exception formatted from the block's own
lines inward.  A thread answers the host at once, even while a block runs:
"where" (spmd.failfast.report.where), and "interrupt", which raises
KeyboardInterrupt in a running block (never in an idle rank).
"""

from __future__ import annotations

import ast
import base64
import builtins
import io
import linecache
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import traceback
from typing import Any

from spmd.util import pickled

__all__ = ["Engine", "INPUT", "bundle"]

#: The file name of block n in tracebacks: "<spmd-n>" (its lines kept by linecache).
INPUT = "<spmd-{}>"


class _Capture(io.TextIOBase):
    """What a block prints on one stream."""

    def __init__(self, name: str) -> None:
        self.parts: list[str] = []
        self.name = name

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def writable(self) -> bool:
        return True

    def text(self) -> str:
        return "".join(self.parts)


def bundle(value: Any) -> dict[str, Any]:
    """A value's rich formats as a notebook shows them (text/html, image/png as base64 ...)."""
    out: dict[str, Any] = {}
    figure = type(value).__module__.startswith("matplotlib") and hasattr(value, "savefig")
    if figure:
        buf = io.BytesIO()
        value.savefig(buf, format="png", bbox_inches="tight")
        out["image/png"] = base64.b64encode(buf.getvalue()).decode()
    for method, mime in (("_repr_html_", "text/html"), ("_repr_markdown_", "text/markdown"),
                         ("_repr_svg_", "image/svg+xml"), ("_repr_png_", "image/png"),
                         ("_repr_latex_", "text/latex")):
        fn = getattr(value, method, None)
        if mime in out or not callable(fn):
            continue
        try:
            data = fn()
        except Exception:
            continue
        if isinstance(data, bytes):
            data = base64.b64encode(data).decode()
        if data is not None:
            out[mime] = data
    return out


def _figures() -> list[dict[str, Any]]:
    """The figures a block left open, as a notebook's inline backend shows them (then closed)."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return []
    shown = []
    for number in pyplot.get_fignums():
        figure = pyplot.figure(number)
        shown.append(bundle(figure))
        pyplot.close(figure)
    return shown


class Engine:
    """This rank's namespace and the loop that runs the host's requests in it."""

    def __init__(self, comm: Any, sock: socket.socket) -> None:
        import spmd

        self.comm, self.sock = comm, sock
        self.ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins, "comm": comm, "spmd": spmd}
        self.busy = False
        self._asked = False  # the host asked for the interrupt that comes
        # The last block the host sent, the last this rank replied to, and one the host interrupted
        # before this rank began it (a Ctrl-C right after Enter): that block stops as it starts.
        self._sent: int | None = None
        self._replied: int | None = None
        self._cancel: int | None = None
        self._send_lock = threading.Lock()
        self.requests: queue.Queue[dict[str, Any] | None] = queue.Queue()
        signal.signal(signal.SIGINT, self._on_interrupt)  # interrupt_main runs it on the main thread
        threading.Thread(target=self._listen, name="spmd-interactive", daemon=True).start()

    def _on_interrupt(self, signum: int, frame: Any) -> None:
        if not self.busy:  # only a running block is interrupted: an idle rank, or one sending its reply, is not
            return
        if not self._asked:  # a SIGINT of its own (its launcher's, at a Ctrl-C): the host interrupts the others
            try:
                self.send({"interrupted": True})
            except OSError:
                pass
        self._asked, self._cancel = False, None
        raise KeyboardInterrupt

    def send(self, message: Any) -> None:
        with self._send_lock:
            pickled.send(self.sock, message)

    def _listen(self) -> None:
        from spmd.failfast.report import where

        while True:
            message = pickled.recv(self.sock)
            if message is None:  # the host has gone: so does this rank
                os._exit(0)
            if message == "where":
                try:
                    self.send({"where": self._where(where(self.comm.rank, self.comm._mon.family))})
                except OSError:
                    pass
            elif message == "interrupt":  # to the main thread itself, so that a sleep or a read ends too
                self._asked = True
                if self._sent != self._replied:  # its block is queued, or running: it stops either way
                    self._cancel = self._sent
                if self.busy:  # checked after _cancel is set: run() checks _cancel after busy is set
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            elif isinstance(message, dict) and message.get("op") == "leave":
                # The session is over: this rank finalizes on its main thread.  Stop listening, so
                # that the host's connection closing (rank 0 exiting first) cannot end this rank
                # before MPI_Finalize: MPICH's mpirun kills the whole job (SIGKILL) when a rank
                # exits without it.
                self.requests.put(message)
                return
            else:
                if isinstance(message, dict) and message.get("op") == "run":
                    self._sent = message["id"]
                self.requests.put(message)

    def _where(self, summary: dict[str, Any]) -> dict[str, Any]:
        """where()'s summary, placed at the user's innermost line, with the user's frames as its stack.

        The user's frames: from the block's own lines inward, up to the
        call into spmd or torch (the call is named already).
        """
        from spmd.util.paths import is_spmd_file

        frame = sys._current_frames().get(threading.main_thread().ident)
        frames = traceback.extract_stack(frame) if frame is not None else []
        first = next((i for i, f in enumerate(frames) if f.filename.startswith("<spmd-")), len(frames))
        mine = []
        for f in frames[first:]:
            if is_spmd_file(f.filename) or "/torch/" in f.filename:
                break
            mine.append(f)
        if mine:
            summary["where"], summary["func"] = f"{mine[-1].filename}:{mine[-1].lineno}", mine[-1].name
        summary["stack"] = "".join(traceback.format_list(mine))
        return summary

    def serve(self) -> None:
        """Run requests until the host says leave."""
        while (request := self.requests.get()) is not None:
            op = request.get("op")
            if op == "leave":
                return
            if op == "run":
                reply = self.run(request["code"], request["id"], request.get("rich", False))
                self._replied = request["id"]
            elif op == "pull":
                reply = self._pull(request["name"])
            elif op == "push":
                self.ns.update(pickle.loads(request["values"]))
                reply = {"pushed": True}
            else:
                reply = {"error": f"unknown request {op!r}"}
            self.send(reply)

    def _pull(self, name: str) -> dict[str, Any]:
        if name not in self.ns:
            return {"error": f"NameError: name {name!r} is not defined on rank {self.comm.rank}"}
        try:
            return {"value": pickle.dumps(self.ns[name], protocol=pickle.HIGHEST_PROTOCOL)}
        except Exception as exc:
            return {"error": f"{name} cannot be sent from rank {self.comm.rank}: {type(exc).__name__}: {exc}"}

    def run(self, code: str, number: int, rich: bool) -> dict[str, Any]:
        """Run one block; return its output, its value and its error as the host merges them."""
        out, err = _Capture("<stdout>"), _Capture("<stderr>")
        name = INPUT.format(number)
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
        value: Any = None
        error = kind = None
        saved = sys.stdout, sys.stderr
        try:
            sys.stdout, sys.stderr = out, err
            self.busy = True
            try:
                if self._cancel == number:  # interrupted before it began
                    self._cancel, self._asked = None, False
                    raise KeyboardInterrupt
                value = self._exec(code, name)
            finally:
                self.busy = False
                sys.stdout, sys.stderr = saved
        except BaseException as exc:  # KeyboardInterrupt and SystemExit too: the session goes on
            error, kind = _format(exc), type(exc).__name__
        reply: dict[str, Any] = {"out": out.text(), "err": err.text(), "error": error, "kind": kind,
                                 "value": None if value is None else _repr(value)}
        if rich:
            reply["mime"] = bundle(value) if value is not None else {}
            reply["figures"] = _figures()
        return reply

    def _exec(self, code: str, name: str) -> Any:
        tree = ast.parse(code, name, "exec")
        last = None
        quiet = code.rstrip().endswith(";")  # as in IPython: a last expression ending in ; shows nothing
        if tree.body and isinstance(tree.body[-1], ast.Expr) and not quiet:
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, name, "exec"), self.ns)
        if last is None:
            return None
        value = eval(compile(last, name, "eval"), self.ns)
        if value is not None:
            self.ns["_"] = value
        return value


def _repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception as exc:
        return f"<repr of {type(value).__name__} failed: {exc!r}>"


def _format(exc: BaseException) -> str:
    """The traceback from the block's own frames inward (the engine's frames left out).

    spmd's errors and an interrupt show the user's frames only: spmd's
    message already quotes the backend's error it was raised from.
    """
    from spmd.errors import SpmdError
    from spmd.util.paths import is_spmd_file

    tb = exc.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<spmd-"):
        tb = tb.tb_next
    if isinstance(exc, SyntaxError):
        tb = None
    if not isinstance(exc, (SpmdError, KeyboardInterrupt)):
        return "".join(traceback.format_exception(type(exc), exc, tb))
    frames = [f for f in traceback.extract_tb(tb) if not is_spmd_file(f.filename)]
    head = "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)) if frames else ""
    return head + "".join(traceback.format_exception_only(type(exc), exc))


def main(sock: socket.socket) -> None:
    """In a rank the host forked: start the world and serve (never returns)."""
    from spmd.runtime.start import init_watched

    try:
        comm = init_watched()
    except BaseException as exc:
        pickled.send(sock, {"failed": _format(exc), "kind": type(exc).__name__})
        os._exit(1)
    engine = Engine(comm, sock)
    engine.send({"hello": os.getpid()})
    engine.serve()
    os._exit(0)
