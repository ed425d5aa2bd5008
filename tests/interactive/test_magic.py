"""The %spmd magic in a real IPython kernel (ipykernel), driven by jupyter_client as a notebook drives it."""

import uuid

import pytest

from benchmarks.notebook import Kernel as NotebookKernel
from tests.support import clean_env, left_behind

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(240)]


def Kernel(mark):
    """A real kernel (benchmarks.notebook's driver) whose processes carry mark."""
    return NotebookKernel(env=clean_env(SPMD_MAGIC_MARK=mark))


@pytest.fixture(scope="module")
def kernel():
    mark = uuid.uuid4().hex
    k = Kernel(mark)
    yield k
    k.close()
    assert left_behind(mark, grace=5.0) == {}, "the kernel's shutdown left spmd's processes behind"


def test_start_cells_rich_values_pull_and_push(kernel):
    assert kernel.cell("%load_ext spmd")[0] == "ok"
    status, text = kernel.text("%spmd start -n 4 --timeout 30")
    assert status == "ok" and "spmd: 4 ranks (gloo) started in" in text
    assert kernel.text("%%spmd\nimport numpy as np\nx = comm.rank\nprint('same')\ncomm.all_reduce(np.ones(1) * x)") \
        == ("ok", "[0-3] same\n[0-3] array([6.])\n")
    status, out = kernel.cell("%%spmd --ranks 0\nclass T:\n    def _repr_html_(self):\n"
                              "        return '<b>rank0</b>'\nT()")
    assert status == "ok" and out[0][0] == "display_data" and out[0][1]["text/html"] == "<b>rank0</b>"
    status, out = kernel.cell("%%spmd --ranks 1\nimport matplotlib\nmatplotlib.use('Agg')\n"
                              "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3]);")
    assert status == "ok" and [kind for kind, _ in out] == ["display_data"] and "image/png" in out[0][1]
    assert kernel.text("%spmd pull x") == ("ok", "[0, 1, 2, 3]\n")
    assert kernel.cell("mine = {'k': 3}\n%spmd push z=mine['k'] * 2")[0] == "ok"
    assert kernel.text("%spmd z + comm.rank") == ("ok", "[0] 6\n[1] 7\n[2] 8\n[3] 9\n")


def test_an_exception_fails_the_cell_shown_once_per_distinct_traceback(kernel):
    status, out = kernel.cell("%%spmd\nif comm.rank >= 2:\n    raise ValueError('big rank')\ncomm.rank")
    assert status == "error"
    assert ("stream", "[0] 0\n[1] 1\n") in out
    error = [c for kind, c in out if kind == "error"][0]
    assert error.count("Traceback (most recent call last):") == 1 and "[2-3] ValueError: big rank" in error


def test_timeout_reports_where_every_rank_is_and_the_world_stays_usable(kernel):
    assert kernel.cell("%spmd timeout 2")[0] == "ok"
    status, out = kernel.cell("%%spmd\nimport time\nwhile comm.rank == 3:\n    time.sleep(0.01)")
    error = [c for kind, c in out if kind == "error"][0]
    assert status == "error" and "[3] KeyboardInterrupt" in error
    assert "the block did not finish within its timeout of 2 s; where the ranks are:" in error
    assert "ranks 0-2: finished" in error
    assert kernel.cell("%spmd timeout off")[0] == "ok"
    assert kernel.text("%spmd pull x") == ("ok", "[0, 1, 2, 3]\n")


def test_the_notebooks_interrupt_reaches_every_rank(kernel):
    status, out = kernel.cell("%%spmd\ntime.sleep(60)", interrupt_after=1.5)
    error = [c for kind, c in out if kind == "error"][0]
    assert status == "error" and "[0-3] KeyboardInterrupt" in error and "spmd: interrupted after" in error
    assert kernel.text("%spmd pull x") == ("ok", "[0, 1, 2, 3]\n")  # the same ranks, the namespace kept
    status, out = kernel.cell("%%spmd\ncomm.barrier() if comm.rank == 0 else time.sleep(60)", interrupt_after=1.5)
    text = "".join(c for kind, c in out if kind in ("stream", "error"))
    assert "rank 0 did not stop within 2 s of the interrupt (inside barrier #" in text
    assert "the world was started afresh on 4 ranks" in text and "variables are gone" in text


def test_a_dead_rank_is_reported_restart_brings_the_world_back_and_stop_ends_it(kernel):
    status, out = kernel.cell("%%spmd\nimport os\nif comm.rank == 1:\n    os._exit(3)\ncomm.barrier()")
    text = "".join(c for kind, c in out if kind in ("stream", "error"))
    assert status == "error" and "the world has ended: rank 1 exited with code 3" in text
    status, text = kernel.text("%spmd restart")
    assert status == "ok" and "spmd: 4 fresh ranks in" in text
    assert kernel.text("%spmd comm.all_reduce(__import__('numpy').ones(1))") == ("ok", "[0-3] array([4.])\n")
    assert kernel.text("%spmd stop") == ("ok", "spmd: the ranks have ended\n")
    status, out = kernel.cell("%%spmd\n1")
    assert status == "error" and "no ranks are running: start them with %spmd start -n 4" in out[-1][1]
    assert kernel.cell("%spmd start -n 2")[0] == "ok"  # left running: the kernel's shutdown must end it


def test_the_mpi_backend_in_a_notebook_launches_mpirun_and_a_stuck_world_is_launched_again():
    mark = uuid.uuid4().hex
    k = Kernel(mark)
    try:
        assert k.cell("%load_ext spmd")[0] == "ok"
        status, text = k.text("%spmd start -n 2 --backend mpi --timeout 3")
        assert status == "ok" and "spmd: 2 ranks (mpi) started in" in text, text
        assert k.text("%spmd comm.backend, comm.all_reduce(__import__('numpy').ones(1))") == \
            ("ok", "[0-1] ('mpi', array([2.]))\n")
        status, out = k.cell("%%spmd\nimport time\ntime.sleep(60)", interrupt_after=1.5)
        error = [c for kind, c in out if kind == "error"][0]
        assert status == "error" and "[0-1] KeyboardInterrupt" in error
        status, out = k.cell("%%spmd\nkeep = 1\ncomm.barrier() if comm.rank else None")
        text = "".join(c for kind, c in out if kind in ("stream", "error"))
        assert "rank 1: waiting in barrier #" in text and "cannot be started afresh here" in text
        assert "spmd: mpirun started 2 fresh ranks in" in text
        assert "NameError: name 'keep' is not defined" in k.text("%spmd keep")[1]
    finally:
        k.close()
    assert left_behind(mark, grace=5.0) == {}
