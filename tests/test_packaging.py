"""What the packaging promises is what is tested: the Python floor, and the test dependencies declared."""

import ast
import configparser
import os
import re
import sys

import pytest

from tests.support import CI, REPO

pytestmark = pytest.mark.unit


def setup_cfg():
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(REPO / "setup.cfg")
    return cfg


def stated_floors():
    """Return {where: (major, minor)} for every place that states the Python floor."""
    requires = setup_cfg()["options"]["python_requires"].strip()
    m = re.fullmatch(r">=\s*(\d+)\.(\d+)", requires)
    assert m, f"setup.cfg python_requires is {requires!r}, not '>=X.Y'"
    found = {"setup.cfg python_requires": (int(m[1]), int(m[2]))}
    readme = re.findall(r"Python (\d+)\.(\d+)\+", (REPO / "README.md").read_text())
    assert readme, "README.md states no 'Python X.Y+'"
    found.update({f"README.md 'Python {a}.{b}+'": (int(a), int(b)) for a, b in readme})
    mypy = setup_cfg()["mypy"]["python_version"].strip()  # tests/test_typing.py checks the code as this Python
    found["setup.cfg [mypy] python_version"] = tuple(int(n) for n in mypy.split("."))
    return found


def test_the_python_floor_is_stated_once_and_is_the_one_tested():
    floors = stated_floors()
    assert len(set(floors.values())) == 1, f"the Python floor is stated differently: {floors}"
    floor = next(iter(floors.values()))
    running = sys.version_info[:2]
    assert running >= floor, f"Python {running} runs below the stated floor {floor}"
    # CI (.ci/run, or any CI that sets CI=true) is what tests the floor: it must run on the floor itself.
    if CI or os.environ.get("CI") == "true":
        assert running == floor, (f"CI runs Python {running[0]}.{running[1]}, but the stated floor is "
                                  f"{floor[0]}.{floor[1]}: run CI on the floor, or state the floor CI tests")


#: The extras bin/setup installs that the tests may rely on (bench's comparisons are importorskip'd).
TEST_EXTRAS = ("test", "mpi", "formats", "interactive", "fast")

#: This repository's own top-level folders, which the tests import from the root.
OURS = ("spmd", "tests", "benchmarks")

#: Calls that import a package their own library does not require (pyarrow's to_pandas needs pandas).
IMPLICIT_IMPORTS = {"to_pandas": "pandas", "to_pandas_dtype": "pandas"}


def declared():
    """Return the normalised names of the distributions install_requires and TEST_EXTRAS declare."""
    options = setup_cfg()["options"]
    extras = setup_cfg()["options.extras_require"]
    lines = options["install_requires"].splitlines() + [l for e in TEST_EXTRAS for l in extras[e].splitlines()]
    return {_normal(m[0]) for line in lines if (m := re.match(r"\s*([A-Za-z0-9._-]+)", line.split("#")[0]))}


def _normal(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def third_party_imports(path):
    """Yield (line, top-level name) of each import in path a test needs from a third-party distribution.

    Not counted: the standard library, this repository's own (OURS), a module beside the file (a script's own
    helper), and a name the file guards with ``pytest.importorskip("name")`` (how a test marks an
    import as optional: it skips where the package is missing). Counted too: IMPLICIT_IMPORTS' calls.
    """
    tree = ast.parse(path.read_text(), str(path))
    optional = {node.args[0].value.partition(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "importorskip" and node.args and isinstance(node.args[0], ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Attribute) and node.attr in IMPLICIT_IMPORTS:
            names = [IMPLICIT_IMPORTS[node.attr]]
        else:
            continue
        for top in {n.partition(".")[0] for n in names}:
            beside = (path.parent / f"{top}.py").exists() or (path.parent / top / "__init__.py").exists()
            if not (top in sys.stdlib_module_names or top in OURS or beside or top in optional):
                yield node.lineno, top


def test_the_scan_finds_the_imports_a_test_needs(tmp_path):
    sample = tmp_path / "test_sample.py"
    sample.write_text("import os, numpy as np\nfrom torch.nn import Linear\nimport helper\nimport spmd.errors\n"
                      "pa = pytest.importorskip('pyarrow')\nimport pyarrow.parquet\nt.to_pandas()\n")
    (tmp_path / "helper.py").write_text("")
    assert sorted(third_party_imports(sample)) == [(1, "numpy"), (2, "torch"), (7, "pandas")]


def test_every_package_the_tests_import_is_declared_in_install_requires_or_the_test_extras():
    from importlib.metadata import packages_distributions

    provides = packages_distributions()
    have = declared()
    assert {"torch", "numpy", "pytest", "mpi4py"} <= have, have
    undeclared = [f"{p.relative_to(REPO)}:{line}: {top} (distribution {', '.join(provides.get(top, ['?']))})"
                  for p in sorted((REPO / "tests").rglob("*.py"))
                  for line, top in sorted(third_party_imports(p))
                  if not any(_normal(d) in have for d in provides.get(top, []))]
    assert not undeclared, (f"tests import packages that neither install_requires nor the extras "
                            f"{', '.join(TEST_EXTRAS)} declare (add it to the test extra in setup.cfg, or mark the "
                            "import optional with pytest.importorskip):\n" + "\n".join(undeclared))
