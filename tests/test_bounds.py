"""The house's bounds, checked on every run: modules that stay readable, a short front door, named signals.

A bound is a signal, not a goal: a module over it is a question (does it hold one job?),
answered by splitting it by responsibility or by listing it, with the reason, in
docs/architecture.md's "Over the bounds" table, which this test reads. Classes have no
bound: a class is as long as its one job.
"""

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "spmd"
MODULE_LINES, TOP_MODULES, README_LINES, DOCSTRING_LINES = 400, 12, 200, 16


def exceptions():
    """Return {path relative to the repo: reason} from docs/architecture.md's "Over the bounds" table."""
    text = (REPO / "docs" / "architecture.md").read_text()
    part = text.split("## Over the bounds", 1)
    if len(part) < 2:
        return {}
    found = {}
    for line in part[1].split("\n## ", 1)[0].splitlines():
        m = re.match(r"\|\s*`(spmd/[^`]+)`\s*\|.*\|\s*(\S.*?)\s*\|\s*$", line)
        if m:
            found[m[1]] = m[2]
    return found


def sources():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_is_over_the_bound():
    allowed = exceptions()
    big = [f"{p.relative_to(REPO)}: {n} lines" for p in sources()
           if (n := len(p.read_text().splitlines())) > MODULE_LINES and str(p.relative_to(REPO)) not in allowed]
    assert not big, (f"modules over {MODULE_LINES} lines (split them by responsibility, or list them with the "
                     "reason in docs/architecture.md's 'Over the bounds'):\n" + "\n".join(big))


def test_the_docs_state_the_bounds_this_test_checks_and_no_other():
    section = (REPO / "docs" / "architecture.md").read_text().split("## Over the bounds", 1)[1].split("\n## ", 1)[0]
    prose = "\n".join(line for line in section.splitlines() if not line.startswith("|"))  # not the table
    stated = {int(n) for n in re.findall(r"\d+", prose)}
    checked = {MODULE_LINES, TOP_MODULES, README_LINES, DOCSTRING_LINES}
    assert stated == checked, (f"docs/architecture.md's 'Over the bounds' states {sorted(stated)}, "
                               f"tests/test_bounds.py checks {sorted(checked)}")


def test_few_modules_sit_directly_in_the_package():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_MODULES, f"{len(top)} modules directly in spmd/ (at most {TOP_MODULES}): {top}"


def test_module_docstrings_are_short_and_point_to_docs():
    long = []
    for p in sources():
        doc = ast.get_docstring(ast.parse(p.read_text(), str(p)), clean=False)
        if doc and (n := len(doc.splitlines())) > DOCSTRING_LINES:
            long.append(f"{p.relative_to(REPO)}: {n} lines")
    assert not long, (f"module docstrings over {DOCSTRING_LINES} lines (the reference belongs in docs/):\n"
                      + "\n".join(long))


def test_the_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines (at most {README_LINES}; move the rest to docs/)"


def literal_signals(tree):
    """Yield line numbers of os.kill / os.killpg / signal.pthread_kill calls whose signal is a number."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("kill", "killpg", "pthread_kill") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, int)
                and node.args[1].value != 0):  # signal 0 probes a pid, it sends nothing
            yield node.lineno


def test_signals_are_named():
    found = [f"{p.relative_to(REPO)}:{line}" for p in sources()
             for line in literal_signals(ast.parse(p.read_text(), str(p)))]
    assert not found, "signals sent by number (use signal.SIGKILL and friends):\n" + "\n".join(found)
    assert list(literal_signals(ast.parse("os.kill(pid, 9)\nos.kill(pid, 0)\nos.kill(p, signal.SIGTERM)"))) == [1]


HISTORY = re.compile(r"\bas before\b|\bissue \d+|\bpart \d+ of issue|_v2\b|(?<!cgroup )\bv2\b", re.I)


def test_no_history_narration_in_code_or_test_names():
    found = []
    for p in sources() + sorted((REPO / "tests").rglob("test_*.py")):
        if p == Path(__file__):
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{p.relative_to(REPO)}:{i}: {line.strip()[:100]}")
    assert not found, "history belongs in git, not in code:\n" + "\n".join(found)
