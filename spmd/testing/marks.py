"""The ``spmd`` marker, read and checked: ``@pytest.mark.spmd(ranks=4, backend=None, timeout=None)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spmd.errors import MarkerError

__all__ = ["Spec", "read", "spec_of", "size_of", "size_id", "PARAM", "BACKENDS", "COMM"]

#: The fixture a list of sizes parametrizes; its value is the test's number of ranks.
PARAM = "spmd_ranks"
#: What the marker's backend may be: None (the default) or one of spmd.init's.
BACKENDS = (None, "auto", "gloo", "mpi", "nccl")


@dataclass(frozen=True)
class Spec:
    """What the marker asks: sizes (one test per size when ranks was a list), backend, timeout."""

    sizes: tuple[int, ...]
    backend: str | None
    timeout: float | None
    parametrized: bool


def _bad(where: str, what: str) -> MarkerError:
    return MarkerError(f"{where}: @pytest.mark.spmd: {what}")


def read(mark: Any, where: str = "test") -> Spec:
    """Return the Spec of a marker, or raise MarkerError naming the test and the fix."""
    args, kwargs = list(mark.args), dict(mark.kwargs)
    if len(args) > 1:
        raise _bad(where, f"takes one positional argument (ranks), got {len(args)}")
    if args and "ranks" in kwargs:
        raise _bad(where, "ranks given twice (positionally and by name)")
    ranks = args[0] if args else kwargs.pop("ranks", None)
    backend = kwargs.pop("backend", None)
    timeout = kwargs.pop("timeout", None)
    if kwargs:
        raise _bad(where, f"unknown argument(s) {sorted(kwargs)}; it takes ranks, backend and timeout")
    if ranks is None:
        raise _bad(where, "say how many ranks: @pytest.mark.spmd(ranks=4), or ranks=[2, 4] for one test per size")
    parametrized = isinstance(ranks, (list, tuple))
    sizes = tuple(ranks) if parametrized else (ranks,)
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise _bad(where, f"ranks must be an int >= 1 or a non-empty list of them, got {ranks!r}")
    if len(set(sizes)) != len(sizes):
        raise _bad(where, f"ranks lists a size twice: {list(sizes)}")
    if backend not in BACKENDS:
        raise _bad(where, f"backend must be one of {[b for b in BACKENDS if b]} or None, got {backend!r}")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise _bad(where, f"timeout must be a number of seconds > 0, got {timeout!r}")
        timeout = float(timeout)
    return Spec(sizes, backend, timeout, parametrized)


def spec_of(item: Any) -> Spec | None:
    """Return the Spec of a collected test marked spmd, else None (the closest marker counts)."""
    mark = item.get_closest_marker("spmd")
    return None if mark is None else read(mark, item.nodeid)


def size_of(item: Any, spec: Spec) -> int:
    """Return the number of ranks this test (one parametrized size of it) runs on."""
    callspec = getattr(item, "callspec", None)
    if spec.parametrized and callspec is not None and PARAM in callspec.params:
        return int(callspec.params[PARAM])
    return spec.sizes[0]


def size_id(n: int) -> str:
    """Return the test id of a size: '4 ranks' ('1 rank')."""
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _comm_key() -> Any:
    import pytest

    return pytest.StashKey()


#: Where a rank keeps its test's communicator, for the comm fixture (config.stash).
COMM = _comm_key()
