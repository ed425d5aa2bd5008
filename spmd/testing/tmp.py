"""One temporary directory tree per test, the same on each of its ranks: ``tmp_path`` shared.

pytest's ``tmp_path_factory`` makes numbered directories, so ranks that
each asked it would each get their own.  ``share`` makes every
``mktemp`` of the test's ranks name the same directory under the test's
own base (the n-th call with a name gives the same path on every rank,
as the ranks run the same fixtures in the same order), and returns how
to put the factory back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

__all__ = ["share"]


def share(config: Any, base: Path) -> Callable[[], None]:
    """Make the test's temporary directories base's, on every rank; return the undo."""
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None:
        return lambda: None
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    before = dict(vars(factory))

    def mktemp(basename: str, numbered: bool = True) -> Path:
        basename = factory._ensure_relative_to_basetemp(basename)
        n = counts.get(basename, 0)
        counts[basename] = n + 1
        path = base / (f"{basename}{n}" if numbered else basename)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path

    factory.mktemp = mktemp
    factory.getbasetemp = lambda: base

    def undo() -> None:
        for name in ("mktemp", "getbasetemp"):
            vars(factory).pop(name, None)
        vars(factory).update({k: v for k, v in before.items() if k not in ("mktemp", "getbasetemp")})

    return undo
