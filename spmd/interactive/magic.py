"""``%load_ext spmd``: the ``%spmd`` and ``%%spmd`` magics of IPython and Jupyter.

``%spmd start -n 4`` starts a Session; a ``%%spmd`` cell runs on every rank
(``--ranks 0`` on some) and shows what they said merged, a single rank's
rich value (a DataFrame, a figure) as the notebook shows it, and any
exception as the cell's error, once per distinct traceback.  The kernel's
interrupt reaches every rank.  ``%spmd`` also takes pull, push, timeout,
restart, stop and status; ``%spmd STATEMENT`` runs one line.
docs/interactive.md is the reference.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from IPython.core.magic import Magics, line_cell_magic, magics_class

from spmd.errors import RanksError, SessionError
from spmd.interactive.merge import render
from spmd.interactive.console import parse_ranks
from spmd.interactive.session import Session
from spmd.util.words import span

__all__ = ["SpmdMagics", "RanksError", "load"]

_COMMANDS = ("start", "stop", "restart", "pull", "push", "timeout", "status")


def _start_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="%spmd start", add_help=False)
    parser.add_argument("-n", "--nprocs", type=int, required=True)
    parser.add_argument("--backend", choices=["gloo", "mpi"], default="gloo")
    parser.add_argument("--timeout", type=float)
    parser.add_argument("--preload", default="")
    return parser


@magics_class
class SpmdMagics(Magics):
    """The magics, holding this kernel's session (one at a time)."""

    session: Session | None = None

    @line_cell_magic
    def spmd(self, line: str, cell: str | None = None) -> Any:
        """%spmd start -n N | stop | restart | pull NAME | push NAME=EXPR | timeout S|off | status | STATEMENT;
        %%spmd [--ranks R] [--timeout S]: run the cell on every rank (or R)."""
        try:
            if cell is not None:
                return self._cell(line, cell)
            word, _, rest = line.strip().partition(" ")
            if word in _COMMANDS:
                return getattr(self, "_" + word)(rest.strip())
            return self._cell("", line)
        except SessionError as exc:
            raise RanksError([f"spmd: {exc}"], str(exc)) from None

    # -- the session -----------------------------------------------------------------

    def _need(self) -> Session:
        if self.session is None or not self.session.alive:
            raise SessionError("no ranks are running: start them with %spmd start -n 4")
        return self.session

    def _start(self, rest: str) -> None:
        try:
            args = _start_parser().parse_args(shlex.split(rest))
        except SystemExit:
            raise SessionError("usage: %spmd start -n N [--backend gloo|mpi] [--timeout SECONDS] "
                               "[--preload MODULES]") from None
        if self.session is not None:
            self.session.stop()
        modules = [m for m in args.preload.split(",") if m]
        self.session = Session(args.nprocs, backend=args.backend, timeout=args.timeout, preload=modules)
        print(f"spmd: {args.nprocs} ranks ({args.backend}) started in {self.session.started_in:.1f} s")

    def _stop(self, rest: str) -> None:
        if self.session is not None:
            self.session.stop()
            self.session = None
        print("spmd: the ranks have ended")

    def _restart(self, rest: str) -> None:
        seconds = self._need().restart()
        print(f"spmd: {self._need().size} fresh ranks in {seconds:.1f} s (every rank's variables are gone)")

    def _status(self, rest: str) -> None:
        if self.session is None or not self.session.alive:
            print("spmd: no ranks are running")
        else:
            limit = "none" if self.session.timeout is None else f"{self.session.timeout:g} s"
            print(f"spmd: {self.session.size} ranks ({self.session.backend or 'gloo'}), timeout {limit}")

    def _timeout(self, rest: str) -> None:
        session = self._need()
        if rest == "off":
            session.timeout = None
        else:
            try:
                session.timeout = float(rest)
            except ValueError:
                raise SessionError(f"%spmd timeout {rest}: give seconds (or off)") from None
            if not session.timeout > 0:
                raise SessionError(f"%spmd timeout {rest}: give seconds > 0 (or off)")

    def _pull(self, rest: str) -> list[Any]:
        name, ranks = _with_ranks(rest, self._need().size)
        if not name.isidentifier():
            raise SessionError(f"%spmd pull {rest}: give a name, as in %spmd pull x [--ranks 0-1]")
        return self._need().pull(name, ranks)

    def _push(self, rest: str) -> None:
        assignment, ranks = _with_ranks(rest, self._need().size)
        target, _, expr = assignment.partition("=")
        if not expr or not target.strip().isidentifier():
            raise SessionError(f"%spmd push {rest}: write %spmd push NAME=EXPR")
        value = self.shell.ev(expr) if self.shell is not None else eval(expr)
        self._need().push({target.strip(): value}, ranks)

    # -- a cell ----------------------------------------------------------------------

    def _cell(self, line: str, cell: str) -> None:
        session = self._need()
        options, ranks = _with_ranks(line, session.size)
        timeout = None
        words = options.split()
        if words[:1] == ["--timeout"] and len(words) == 2:
            timeout = float(words[1])
        elif words:
            raise SessionError(f"%%spmd {line}: the options are --ranks R and --timeout SECONDS")
        reply = session.run(cell, ranks, timeout, rich=True)
        _show(reply)


def _with_ranks(text: str, size: int) -> tuple[str, list[int] | None]:
    """Split '--ranks R' off text; return the rest and the ranks (None: every rank)."""
    words = text.split()
    if "--ranks" not in words:
        return text.strip(), None
    i = words.index("--ranks")
    if i + 1 >= len(words):
        raise SessionError("--ranks needs ranks: 0, 0,2, 1-3 or all")
    ranks = parse_ranks(words[i + 1], size)
    return " ".join(words[:i] + words[i + 2:]), ranks


def _show(reply: dict[str, Any]) -> None:
    """Print what the ranks said; a single rank's rich value and every figure as the notebook shows them."""
    from IPython.display import publish_display_data

    results: dict[int, dict[str, Any]] = reply.get("results", {})
    valued = {r: res for r, res in results.items() if res.get("value") is not None}
    rich = len(valued) == 1 and len(results) == 1
    plain = {"results": {r: dict(res, value=None if rich else res.get("value"), error=None)
                         for r, res in results.items()}}
    text = render(plain)
    if text:
        print(text, end="")
    if rich:
        (rank, res), = valued.items()
        publish_display_data({"text/plain": res["value"], **res.get("mime", {})})
    for rank, res in sorted(results.items()):
        for figure in res.get("figures", []):
            if len(results) > 1:
                print(f"[{rank}]")
            publish_display_data({"text/plain": f"<figure of rank {rank}>", **figure})
    errors = {r: res["error"] for r, res in results.items() if res.get("error")}
    notes = [n for n in reply.get("notes", []) if n]
    if errors or notes:
        lines = render({"results": {r: {"error": e} for r, e in errors.items()}, "notes": notes}).rstrip("\n")
        kinds = sorted({res.get("kind") or "error" for res in results.values() if res.get("error")})
        summary = (f"rank(s) {span(errors)} raised {', '.join(kinds)}" if errors else notes[0])
        if errors:
            raise RanksError(lines.split("\n"), summary)
        print(lines)


def load(ipython: Any) -> None:
    """Register the magics with ipython (``%load_ext spmd`` calls it)."""
    ipython.register_magics(SpmdMagics)

