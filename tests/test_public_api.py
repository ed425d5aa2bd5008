"""The public paths users write keep working, whatever moves inside the package."""

import importlib
import subprocess

import pytest

import spmd
from tests.support import PY, REPO, clean_env, tool

pytestmark = pytest.mark.unit

#: module -> names a user imports from it.
PUBLIC = {
    "spmd": ["comm", "init", "finalize", "initialized", "run_command", "Comm", "Handle", "SpmdError", "CollectiveError",
             "CollectiveTimeout", "PeerLostError", "PipelineError", "DataParallelError", "CheckpointError"],
    "spmd.errors": list(spmd.errors.__all__),
    "spmd.pipeline": ["pipeline", "Result", "NpySource", "ShardSource", "SyntheticTable", "CsvSource"],
    "spmd.pipeline.sources": ["NpySource", "ShardSource", "SyntheticTable", "ArraySource", "CsvSource", "open_source"],
    "spmd.tasks": ["register", "get", "fixed_batches"],
    "spmd.data_parallel": ["DataParallel"],
    "spmd.checkpoint": ["save_checkpoint", "load_checkpoint", "atomic_save"],
    "spmd.preempt": ["on_preempt", "preempted", "any_preempted", "install"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_each_public_path_imports(module):
    mod = importlib.import_module(module)
    missing = [n for n in PUBLIC[module] if not hasattr(mod, n)]
    assert not missing, f"{module} lacks {missing}"
    assert set(PUBLIC[module]) <= set(getattr(mod, "__all__", PUBLIC[module])) | {"Comm", "Handle", "comm"}


def test_the_public_names_are_the_real_objects():
    from spmd.comms.comm import Comm
    from spmd.comms.handle import Handle
    from spmd.pipeline.run import pipeline
    from spmd.train.data_parallel import DataParallel

    assert spmd.Comm is Comm and spmd.Handle is Handle
    assert spmd.pipeline.pipeline is pipeline and spmd.data_parallel.DataParallel is DataParallel
    assert spmd.tasks.register is importlib.import_module("spmd.pipeline.tasks").register
    assert spmd.preempt.on_preempt is importlib.import_module("spmd.runtime.preempt").on_preempt


def test_python_m_spmd_and_the_spmd_command_run(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("from spmd import comm\nprint('hello', comm.rank, comm.size)\n")
    out = subprocess.run([PY, "-m", "spmd", str(script)], env=clean_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["hello", "0", "1"], out.stdout + out.stderr
    out = subprocess.run([tool("spmd"), "--help"], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and all(c in out.stdout for c in ("run", "submit", "bench", "info")), out.stdout
    for wrapper in ("setup", "test", "bench", "submit"):
        assert (REPO / "bin" / wrapper).stat().st_mode & 0o111, f"bin/{wrapper} is not executable"


def public_modules():
    """Return the public modules: every module directly in spmd/ (the public paths) and spmd.pipeline.

    Each is named in README.md or docs/ (checked), so a user may reach it as ``spmd.<name>``.
    """
    names = sorted({p.stem for p in (REPO / "spmd").glob("*.py")} - {"__init__", "__main__"} | {"pipeline"})
    docs = (REPO / "README.md").read_text() + "".join(p.read_text() for p in (REPO / "docs").glob("*.md"))
    unnamed = [n for n in names if f"spmd.{n}" not in docs]
    assert not unnamed, f"public modules that README.md and docs/ never name: {unnamed}"
    return names


def test_every_public_module_is_an_attribute_after_a_bare_import_spmd():
    """A fresh `import spmd` loads neither torch nor mpi4py, and every public module is then ``spmd.<name>``.

    In a fresh interpreter no earlier import has set the attribute, so Python asks the package's
    ``__getattr__`` (PEP 562): calling it here is that path, without paying torch's import again.
    """
    names = public_modules()
    assert {"checkpoint", "data_parallel", "tasks", "preempt", "repl", "pipeline", "errors"} <= set(names)
    code = "import sys, spmd\nprint(sorted(m for m in ('torch', 'mpi4py') if m in sys.modules))\n"
    out = subprocess.run([PY, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "[]\n", f"a bare `import spmd` imported {out.stdout}{out.stderr}"
    unreachable = []
    for name in names:
        try:
            module = spmd.__dict__.get(name) if name == "errors" else spmd.__getattr__(name)
        except AttributeError:
            module = None
        if module is not importlib.import_module(f"spmd.{name}"):
            unreachable.append(name)
    assert not unreachable, f"after `import spmd`, spmd.<name> is not the module for {unreachable}"
