"""``spmd repl``: a terminal prompt whose every statement runs on every rank, output merged.

Python's own console (``code.InteractiveConsole``: multi-line blocks,
readline's editing and a history file) with each complete block sent to
a Session.  Lines that start with ``%`` are the session's commands
(``%help`` lists them); Ctrl-C while a block runs interrupts it on every
rank; Ctrl-D (or ``exit()``) ends the session and its ranks.
"""

from __future__ import annotations

import ast
import code
import codeop
import os
import sys
from typing import Any

from spmd.errors import SessionError
from spmd.interactive.merge import render
from spmd.interactive.session import Session
from spmd.util.words import span

__all__ = ["Console", "parse_ranks", "HELP", "main"]

HELP = """\
Each statement runs on every rank; comm and spmd are defined there.
  %on RANKS [STATEMENT]  run STATEMENT on RANKS only (0 | 0,2 | 1-3); without one, every
                         later statement runs there (%on all: every rank again)
  %pull NAME             NAME's value on every rank (of %on's), as a list in rank order
  %push NAME=EXPR        set NAME on every rank (of %on's) to EXPR, evaluated here
  %timeout SECONDS|off   report where every rank is and interrupt a block that runs longer
  %restart               end the ranks and start as many fresh ones (the variables are lost)
  %help                  this text
Ctrl-C interrupts a running block on every rank; Ctrl-D or exit() leaves."""

_LEAVE = {"exit", "exit()", "quit", "quit()"}


def parse_ranks(text: str, size: int) -> list[int] | None:
    """'all' -> None; '0', '0,2', '1-3', '0,2-3' -> sorted ranks; SessionError naming the fix else."""
    if text == "all":
        return None
    ranks: set[int] = set()
    try:
        for part in text.split(","):
            first, dash, last = part.partition("-")
            ranks.update(range(int(first), int(last if dash else first) + 1))
    except ValueError:
        raise SessionError(f"{text!r} is not a list of ranks: write 0, 0,2, 1-3 or all") from None
    bad = sorted(r for r in ranks if not 0 <= r < size)
    if bad or not ranks:
        raise SessionError(f"ranks {text!r}: this world has ranks 0-{size - 1}")
    return sorted(ranks)


class Console(code.InteractiveConsole):
    """The prompt: each complete block goes to the session's ranks."""

    def __init__(self, session: Session) -> None:
        super().__init__(locals={}, filename="<spmd>")
        self.session = session
        self.ranks: list[int] | None = None  # %on's ranks for every statement, None: all
        self.leaving = False  # exit() was typed
        self.fatal = False  # the session cannot go on (a launched world's ranks stuck in a call)

    def raw_input(self, prompt: str = "") -> str:
        if self.leaving or self.fatal:
            raise EOFError  # interact() ends as at Ctrl-D
        return super().raw_input(prompt)

    def runsource(self, source: str, filename: str = "<spmd>", symbol: str = "single") -> bool:
        stripped = source.strip()
        if stripped.startswith("%"):
            self._command(stripped)
            return False
        if stripped in _LEAVE:
            self.leaving = True
            return False
        try:
            compiled = codeop.compile_command(source, filename, "single")
        except (OverflowError, SyntaxError, ValueError):
            self.showsyntaxerror(filename)  # once, here: every rank would raise the same
            return False
        if compiled is None:
            return True  # more lines to come
        self._run(source, self.ranks)
        return False

    def _run(self, source: str, ranks: list[int] | None) -> None:
        before = self.session.interrupts
        try:
            reply = self.session.run(source, ranks)
            self.write(("\n" if self.session.interrupts != before else "") + render(reply))
            self.fatal = bool(reply.get("fatal"))
        except SessionError as exc:
            self.write(f"spmd: {exc}\n")

    def write(self, data: str) -> None:
        sys.stdout.write(data)
        sys.stdout.flush()

    def _command(self, line: str) -> None:
        name, _, rest = line[1:].partition(" ")
        rest = rest.strip()
        try:
            if name == "on":
                self._on(rest)
            elif name == "pull" and rest.isidentifier():
                self.write(repr(self.session.pull(rest, self.ranks)) + "\n")
            elif name == "push" and "=" in rest:
                target, _, expr = rest.partition("=")
                if not target.strip().isidentifier():
                    raise SessionError(f"%push {rest}: write %push NAME=EXPR")
                value = eval(expr, self.locals)
                self.session.push({target.strip(): value}, self.ranks)
            elif name == "timeout" and rest:
                self.session.timeout = None if rest == "off" else _positive(rest)
                self.write(f"spmd: blocks time out after {rest} s\n" if rest != "off" else "spmd: no timeout\n")
            elif name == "restart" and not rest:
                seconds = self.session.restart()
                self.write(f"spmd: {self.session.size} fresh ranks in {seconds:.1f} s (the variables are lost)\n")
            elif name == "help":
                self.write(HELP + "\n")
            else:
                raise SessionError(f"%{name} {rest}".strip() + ": not a command; %help lists them")
        except SessionError as exc:
            self.write(f"spmd: {exc}\n")
        except Exception as exc:  # %push's expression, evaluated here
            self.write(f"spmd: {type(exc).__name__}: {exc}\n")

    def _on(self, rest: str) -> None:
        spec, _, statement = rest.partition(" ")
        if not spec:
            raise SessionError("%on needs ranks: %on 0 print(x), or %on 1-3 to run there from now on")
        ranks = parse_ranks(spec, self.session.size)
        if statement.strip():
            ast.parse(statement)  # a SyntaxError is shown here once
            self._run(statement, ranks)
            return
        self.ranks = ranks
        where = "every rank" if ranks is None else f"rank(s) {span(ranks)}"
        self.write(f"spmd: statements run on {where}\n")
        self.ps1 = ">>> " if ranks is None else f"[{span(ranks)}] >>> "
        sys.ps1 = self.ps1


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise SessionError(f"{text!r} is not a number of seconds > 0 (or off)")
    return value


def _history() -> Any:
    """Load readline's history file; return the function that saves it (None without readline)."""
    try:
        import readline
    except ImportError:
        return None
    path = os.environ.get("SPMD_REPL_HISTORY", os.path.expanduser("~/.spmd_history"))
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(10000)

    def save() -> None:
        try:
            readline.write_history_file(path)
        except OSError:
            pass
    return save


def main(nprocs: int, backend: str | None = None, timeout: float | None = None,
         preload: list[str] | None = None) -> int:
    """Start a session of nprocs ranks and prompt until Ctrl-D; return the exit status."""
    print(f"spmd repl: starting {nprocs} rank{'s' if nprocs > 1 else ''} ...", flush=True)
    try:
        session = Session(nprocs, backend=backend, timeout=timeout, preload=preload)
    except SessionError as exc:
        print(f"spmd repl: {exc}", file=sys.stderr)
        return 1
    save = _history()
    console = Console(session)
    banner = (f"spmd repl: {nprocs} rank{'s' if nprocs > 1 else ''} ({backend or 'gloo'}), started in "
              f"{session.started_in:.1f} s; every statement runs on every rank, with comm and spmd "
              "defined. %help lists the commands; Ctrl-D leaves.")
    try:
        sys.ps1, sys.ps2 = ">>> ", "... "
        console.interact(banner=banner, exitmsg="")
    finally:
        if save is not None:
            save()
        session.stop()
    return 0
