"""docs/architecture.md's map ("Where each concern lives") names every module of spmd/ and benchmarks/."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "spmd"
#: The folders the map covers: the package, and the benchmarks beside it.
MAPPED = (PACKAGE, REPO / "benchmarks")
FILE = re.compile(r"(?<![\w/.])([A-Za-z_]\w*\.py)\b")


def the_map(text=None):
    """Return the lines of the fenced block under docs/architecture.md's "## Where each concern lives"."""
    text = (REPO / "docs" / "architecture.md").read_text() if text is None else text
    part = text.split("## Where each concern lives", 1)[1]
    return part.split("```", 2)[1].splitlines()[1:]


def named(lines):
    """Return {folder path: set of file names} that the map's lines name, by this rule.

    A line whose first word ends in "/" names a folder (``spmd/`` at the top); every ``name.py`` on
    that line belongs to that folder, whose parent is the folder of the nearest line above that is
    indented less. Any other line belongs to the folder of the nearest line above it that is indented
    less: so a folder's column of modules, and text wrapped deeper, stay in its folder, and a line
    back at a folder's own indentation is its parent's.
    """
    stack = []  # (indentation, folder path) of the lines above, each indented more than the one before
    found = {}
    for line in lines:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        first = line.split()[0]
        folder = f"{parent}{first}" if first.endswith("/") else parent
        found.setdefault(folder, set()).update(FILE.findall(line))
        stack.append((indent, folder))
    return found


def test_the_rule_reads_a_map_as_drawn():
    sample = ["spmd/", "  errors.py   the tree", "  util/    a.py    what a holds", "            b.py c.py  two",
              "               wrapped text naming d.py", "  comms/   base.py", "            api/   e.py",
              "              f.py   under api", "            g.py    back in comms", "  h.py      at the top"]
    assert named(sample) == {"spmd/": {"errors.py", "h.py"}, "spmd/util/": {"a.py", "b.py", "c.py", "d.py"},
                             "spmd/comms/": {"base.py", "g.py"}, "spmd/comms/api/": {"e.py", "f.py"}}


def test_the_map_names_every_module_in_its_folder():
    found = named(the_map())
    modules = sorted(p.relative_to(REPO) for folder in MAPPED for p in folder.rglob("*.py")
                     if p.name != "__init__.py" and "__pycache__" not in p.parts)
    assert len(modules) > 100 and any(m.parts[0] == "benchmarks" for m in modules)
    missing = [str(m) for m in modules if m.name not in found.get(f"{m.parent.as_posix()}/", set())]
    assert not missing, ("docs/architecture.md's map ('Where each concern lives') does not name these modules "
                         "in their folders (add each, with a short phrase, on its folder's lines):\n"
                         + "\n".join(missing))
    gone = sorted(f for f in found if not (REPO / f).is_dir())
    assert not gone, f"the map names folders that do not exist: {gone}"
