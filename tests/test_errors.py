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


#: "path relative to spmd/:Class" -> why it derives from BaseException but is no error (an exit, not a failure).
NOT_ERRORS = {
    "runtime/usage.py:UsageExit": "a SystemExit: the rank ends with a usage error's status, said once; "
                                  "`except Exception` must not catch it",
}

#: Words that end the names of exception classes of other packages (click.ClickException, ...).
_EXCEPTION_WORDS = ("Error", "Exception", "Exit", "Timeout", "Interrupt", "Warning")


def exception_classes(paths):
    """Return sorted (path, class name) of the classes under paths that may be exceptions, read with ast.

    A class is one when a base's name ends in an exception word, names a builtin exception, or names
    another class found so far (repeated until nothing new is found); the import then decides.
    """
    import builtins

    known = {n for n, v in vars(builtins).items() if inspect.isclass(v) and issubclass(v, BaseException)}
    classes = [(p, node.name, [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases])
               for p in paths for node in ast.parse(p.read_text(), str(p)).body if isinstance(node, ast.ClassDef)]
    found = set()
    while True:
        new = {(p, name) for p, name, bases in classes
               if any(b in known or b.endswith(_EXCEPTION_WORDS) for b in bases)} - found
        if not new:
            return sorted(found)
        found |= new
        known |= {name for _, name in new}


def test_the_class_scan_finds_exceptions_through_their_bases(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("class A(ValueError): pass\nclass B(A): pass\nclass C(click.ClickException): pass\n"
                      "class D(object): pass\nclass E(B, D): pass\nclass Plain: pass\n")
    assert [name for _, name in exception_classes([sample])] == ["A", "B", "C", "E"]


def test_every_exception_class_anywhere_in_spmd_is_an_spmd_error():
    """Every exception class under spmd/, wherever it is defined, derives from SpmdError (one tree to catch).

    Each module that defines one is imported; one whose optional dependency is missing here is
    skipped, naming it (and fails in CI, where every extra is installed).
    """
    import importlib
    import importlib.util

    from tests.support import missing

    outside, unchecked = [], []
    for path, name in exception_classes(sorted(PACKAGE.rglob("*.py"))):
        rel = path.relative_to(PACKAGE).with_suffix("")
        module = ".".join(("spmd",) + rel.parts)
        try:
            cls = getattr(importlib.import_module(module), name)
        except ModuleNotFoundError as exc:
            top = (exc.name or "").partition(".")[0]
            if top == "spmd" or importlib.util.find_spec(top) is not None:
                raise
            unchecked.append(f"{module}.{name} (needs {top})")
            continue
        key = f"{rel.as_posix()}.py:{name}"
        if not (inspect.isclass(cls) and issubclass(cls, BaseException)):
            continue
        if key in NOT_ERRORS:
            assert not issubclass(cls, Exception), f"{key} is an Exception: derive it from SpmdError instead"
        elif not issubclass(cls, spmd.SpmdError):
            outside.append(f"spmd/{key} ({', '.join(b.__name__ for b in cls.__bases__)})")
    assert not outside, "exception classes outside the SpmdError tree:\n" + "\n".join(outside)
    if unchecked:
        missing("not imported, their dependency is missing: " + ", ".join(unchecked))
