"""No import cycle anywhere in spmd/: every module's imports, read with ast, form a graph without loops.

An edge A -> B means that running A may import B: a module-level import or one
inside a function (it runs at some call), ``from . import x`` where x is a
submodule, ``from .pkg import name`` (spmd.pkg, and spmd.pkg.name when that is a
submodule), and the ``__init__`` of every package the import passes through,
except the packages A itself lies in (those ran before A did).
"""

import ast
import pathlib

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[1] / "spmd"

#: Cycles allowed while a colleague's fix is under way, as sorted tuples of modules;
#: each is allowed only while it is still there (a fixed one fails the test until removed).
KNOWN = set()


def modules(root=ROOT):
    """Map each module name under root (a package named spmd) to its file."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _package(name, path):
    """The package a module's relative imports start from."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _with_packages(target, importer, known):
    """target and the packages on its way that importer does not already lie in."""
    parts = target.split(".")
    out = []
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name in known and name != importer and not importer.startswith(name + "."):
            out.append(name)
    return out


def imports(name, path, known):
    """Return the spmd modules that importing (or calling into) module name may import."""
    tree = ast.parse(path.read_text(), str(path))
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package(name, path).split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            targets.add(source)
            targets.update(f"{source}.{alias.name}" for alias in node.names)
    edges = set()
    for target in targets:
        if target == "spmd" or target.startswith("spmd."):
            edges.update(_with_packages(target, name, known))
    edges.discard(name)
    return edges


def graph(root=ROOT):
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def components(edges):
    """Tarjan's strongly connected components with more than one module."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.add(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(tuple(sorted(part)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def cycles(edges, part, limit=20):
    """Up to limit elementary cycles inside one component, each starting at its least module."""
    inside = set(part)
    found = []

    def walk(path):
        for w in sorted(edges[path[-1]] & inside):
            if w == path[0]:
                found.append(path + [w])
            elif w > path[0] and w not in path and len(found) < limit:
                walk(path + [w])

    for start in sorted(inside):
        walk([start])
    return found[:limit]


def describe(edges, parts):
    lines = []
    for part in parts:
        lines.append(f"cycle among {', '.join(part)}:")
        lines.extend("    " + " -> ".join(c) for c in cycles(edges, part))
    return "\n".join(lines)


def test_the_graph_sees_every_kind_of_import(tmp_path):
    files = {
        "__init__.py": "from .run import go\n",
        "errors.py": "",
        "run.py": ("import os\nfrom .errors import E\nfrom . import tool\nfrom . import name_in_init\n"
                   "def go():\n    from .pkg.deep import f\n    import spmd.other\n"),
        "tool.py": "from .pkg import deep, NAME\n",
        "other.py": "import spmd\nfrom .. import outside\n",
        "pkg/__init__.py": "NAME = 1\n",
        "pkg/deep.py": "from . import NAME\nfrom ..errors import E\n",
    }
    for name, text in files.items():
        (tmp_path / "spmd" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "spmd" / name).write_text(text)
    edges = graph(tmp_path / "spmd")
    assert edges["spmd"] == {"spmd.run"}
    # module level, a submodule by from-import, and inside a function (with the package's __init__)
    assert edges["spmd.run"] == {"spmd.errors", "spmd.tool", "spmd.pkg", "spmd.pkg.deep", "spmd.other"}
    assert edges["spmd.tool"] == {"spmd.pkg", "spmd.pkg.deep"}  # a name of pkg is an edge to pkg only
    assert edges["spmd.other"] == set()  # its own package ran before it
    assert edges["spmd.pkg.deep"] == {"spmd.errors"}  # pkg, its own package, ran first
    assert edges["spmd.pkg"] == set()
    assert components(edges) == []


def test_every_cycle_is_named():
    edges = {"a": {"b"}, "b": {"a", "c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}}
    parts = components(edges)
    assert parts == [("a", "b", "c"), ("e", "f")]
    assert describe(edges, parts) == (
        "cycle among a, b, c:\n    a -> b -> a\n    a -> b -> c -> a\ncycle among e, f:\n    e -> f -> e")


def test_no_import_cycle():
    edges = graph()
    found = components(edges)
    unexpected = [p for p in found if p not in KNOWN]
    fixed = [p for p in KNOWN if p not in found]
    assert not unexpected, "import cycles in spmd/:\n" + describe(edges, unexpected)
    assert not fixed, f"no longer a cycle, remove from KNOWN: {fixed}"


#: The authenticated servers' thread, which the hub's rank 0 side is.
AUTHSERVER = {"spmd.util", "spmd.util.authserver"}
#: The fail-fast hub's own modules.
HUB = {f"spmd.failfast.hub.{m}" for m in ("base", "client", "judge", "peers", "messages", "relay", "share")}


@pytest.mark.parametrize("module, allowed", [
    ("spmd.config.settings", {"spmd.errors", "spmd.util", "spmd.util.units"}),
    ("spmd.failfast.abort", {"spmd.errors", "spmd.config", "spmd.config.placement", "spmd.failfast.report"}),
    ("spmd.failfast.hub", {"spmd.failfast.abort", "spmd.failfast.report", *HUB, *AUTHSERVER}),
    ("spmd.failfast.hub.relay", {"spmd.failfast.abort", "spmd.failfast.report", *HUB, *AUTHSERVER}),
    ("spmd.failfast.hub.judge", {"spmd.failfast.report", "spmd.failfast.hub.messages", "spmd.util",
                                 "spmd.util.words"}),  # no sockets, no threads
    ("spmd.failfast.mpi_timeout", {"spmd.failfast.abort", "spmd.failfast.calls"}),
    ("spmd.failfast.report", {"spmd.failfast.calls", "spmd.util", "spmd.util.paths", "spmd.util.words"}),
    ("spmd.runtime.proxy", {"spmd.runtime.start", "spmd.comms", "spmd.comms.comm"}),
])
def test_the_runtime_reads_in_one_direction(module, allowed):
    """settings and abort know nothing of the runtime; the guards and the global comm only what they use."""
    assert graph()[module] <= allowed


# -- layers: a subpackage imports only from its own floor or below ------------------------

#: docs/architecture.md draws these floors; the top-level public modules stand above all.
FLOORS = {
    "errors": 0, "util": 1, "config": 2, "failfast": 3, "comms": 4, "runtime": 5,
    "launch": 6, "submit": 6, "pipeline": 7, "train": 7, "interactive": 7, "bench": 8, "testing": 8, "doctor": 8, "cli": 9,
}
TOP = 10  # spmd/__init__.py, __main__.py and the public re-exports (spmd.tasks, spmd.preempt, ...)


def floor(module):
    parts = module.split(".")
    return FLOORS.get(parts[1], TOP) if len(parts) > 1 else TOP


def room(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FLOORS else None


def test_every_subpackage_is_on_a_floor():
    rooms = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms <= set(FLOORS), f"subpackages without a floor in FLOORS: {sorted(rooms - set(FLOORS))}"


def against_the_floors(edges):
    """Return 'a -> b' for each import that points up a floor, or across to another room of one floor."""
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                  if floor(b) > floor(a) or (floor(b) == floor(a) < TOP and room(a) != room(b)))


def test_imports_point_down_or_stay_in_their_subpackage():
    up = against_the_floors(graph())
    assert not up, "imports that point up a floor or across one (FLOORS above):\n" + "\n".join(up)


def test_the_layer_check_sees_an_upward_and_a_sideways_import():
    edges = {
        "spmd.comms.base": {"spmd.pipeline.run", "spmd.errors", "spmd.comms.call"},  # up, down, own room
        "spmd.launch.x": {"spmd.submit.y"},  # across floor 6
        "spmd.cli.bench": {"spmd.bench.cases"},  # down
        "spmd": {"spmd.cli"},  # the public top imports anything
    }
    assert against_the_floors(edges) == ["spmd.comms.base -> spmd.pipeline.run", "spmd.launch.x -> spmd.submit.y"]


# -- no private names across subpackages ---------------------------------------------------

def private_imports(root=ROOT):
    """Yield (module, line, imported) for each underscore name imported from another subpackage."""
    known = modules(root)
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = _package(name, path).split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("spmd"):
                continue
            for alias in node.names:
                target = f"{source}.{alias.name}"
                where = target if target in known else source
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                private = private or any(p.startswith("_") and not p.startswith("__")
                                         for p in source.split("."))
                if private and room(where) != room(name):
                    yield name, node.lineno, f"{source}.{alias.name}"


def test_no_module_imports_another_subpackages_private_names():
    found = [f"{m}:{line} imports {what}" for m, line, what in private_imports()]
    assert not found, "private names imported across subpackages (make them public or move them):\n" + "\n".join(found)


def test_the_private_import_check_sees_one(tmp_path):
    for name, text in {"__init__.py": "", "a/__init__.py": "", "a/x.py": "_hidden = 1\n",
                       "b/__init__.py": "", "b/y.py": "from spmd.a.x import _hidden\nfrom ..a import x\n",
                       "a/z.py": "from .x import _hidden\n"}.items():
        (tmp_path / "spmd" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "spmd" / name).write_text(text)
    global FLOORS
    saved = FLOORS
    FLOORS = {"a": 1, "b": 2}
    try:
        found = list(private_imports(tmp_path / "spmd"))
    finally:
        FLOORS = saved
    assert found == [("spmd.b.y", 1, "spmd.a.x._hidden")]


# -- the package stands alone --------------------------------------------------------------

def outside_imports(root=ROOT, outside=("benchmarks", "tests")):
    """Yield (module, line, imported) for each import of the repository's folders beside the package."""
    for name, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                sources = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                sources = [node.module]
            else:
                continue
            yield from ((name, node.lineno, s) for s in sources if s.partition(".")[0] in outside)


def test_the_package_imports_neither_benchmarks_nor_tests():
    found = [f"{m}:{line} imports {what}" for m, line, what in outside_imports()]
    assert not found, "spmd imports folders an installed package lacks (benchmarks/, tests/):\n" + "\n".join(found)


def test_the_outside_import_check_sees_one(tmp_path):
    (tmp_path / "spmd").mkdir()
    (tmp_path / "spmd" / "a.py").write_text("import os\nfrom benchmarks import formats\n")
    assert list(outside_imports(tmp_path / "spmd")) == [("spmd.a", 2, "benchmarks")]
