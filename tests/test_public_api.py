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
    from spmd.comms.base import Comm
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
