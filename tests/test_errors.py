"""spmd.errors: one tree under SpmdError, exported from spmd, and no builtin raised in its place."""

import ast
import inspect
from pathlib import Path

import pytest

import spmd
from spmd import errors

pytestmark = pytest.mark.unit

PACKAGE = Path(spmd.__file__).parent

#: Builtins spmd raises only through a class of spmd.errors that derives from them.
BUILTINS = ("ValueError", "RuntimeError", "TypeError", "KeyError", "Exception")

#: (path relative to spmd/, builtin) -> why it must stay a builtin there. Keep it empty
#: unless Python itself requires the builtin; say why in the value.
ALLOWED = {}


def test_every_error_is_an_spmd_error_exported_from_spmd():
    classes = {n: getattr(errors, n) for n in errors.__all__ if inspect.isclass(getattr(errors, n))}
    assert classes and all(issubclass(c, BaseException) for c in classes.values()), classes
    outside = sorted(n for n, c in classes.items() if not issubclass(c, spmd.SpmdError))
    assert not outside, f"not derived from spmd.SpmdError: {outside}"
    missing = sorted(n for n, c in classes.items() if n not in spmd.__all__ or getattr(spmd, n, None) is not c)
    assert not missing, f"in spmd.errors.__all__ but not exported from spmd (__all__ and attribute): {missing}"


def _builtin_raises(path):
    """Yield (line, name) of every ``raise Name`` or ``raise Name(...)`` of a builtin in BUILTINS."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in BUILTINS:
                yield node.lineno, exc.id


def test_no_module_raises_a_builtin_where_an_spmd_error_belongs():
    offenders = [
        f"spmd/{rel}:{line}: raise {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for rel in [path.relative_to(PACKAGE).as_posix()]
        for line, name in sorted(_builtin_raises(path))
        if (rel, name) not in ALLOWED
    ]
    assert not offenders, (
        f"{len(offenders)} raise(s) of a builtin; raise the spmd.errors class that fits "
        "(add one there, deriving from the builtin, if none does):\n" + "\n".join(offenders)
    )


def test_the_scan_finds_what_it_is_meant_to_find(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("raise ValueError('x')\nraise KeyError\nraise SpmdError('y')\n"
                      "try:\n    pass\nexcept TypeError:\n    raise\n")
    assert sorted(_builtin_raises(sample)) == [(1, "ValueError"), (2, "KeyError")]


def test_a_lost_peer_is_recognised_by_its_error_or_by_the_words_backends_use():
    from spmd.errors import PEER_LOST, PeerLostError, is_peer_lost

    said = {  # what gloo, MPI and the operating system say when the other side is gone
        "closed by peer": "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:10937",
        "reset by peer": "MPI_ERR_OTHER: Connection reset by peer",
        "Broken pipe": "[Errno 32] Broken pipe",
        "Connection refused": "[Errno 111] Connection refused",
    }
    assert sorted(said) == sorted(PEER_LOST)
    assert all(is_peer_lost(RuntimeError(text)) for text in said.values())
    assert is_peer_lost(ConnectionResetError(104, "Connection reset by peer"))
    assert is_peer_lost(PeerLostError("rank 0: broadcast (call #2) failed"))  # spmd's own, whatever its words
    for text in ("connection closed", "Timed out waiting 6000ms for recv", "peer 3 is slow", ""):
        assert not is_peer_lost(RuntimeError(text)), text
