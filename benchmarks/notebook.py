"""Cells in a real Jupyter kernel: ``%%spmd`` beside ipyparallel's ``%%px``, timed as a notebook waits for them.

Two kernels (ipykernel, started and driven by jupyter_client as Jupyter
does), both alive throughout: one with ``%spmd start -n RANKS``, one with
an ipyparallel Cluster of RANKS mpiexec engines and ``%px`` activated.  A
cell's time runs from the execute request to the kernel's idle status and
its reply, so the kernel's own round trip is in both tools' times.  The
cells alternate, the order of the two tools swapped every repeat, medians
of REPEATS: a plain ``x = 1`` cell in each kernel (that round trip), then
``x = 1`` and an all-reduce of 8 float64 (``comm.all_reduce`` beside
mpi4py's ``Allreduce``), each checked by its sum.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from spmd.errors import BenchError

__all__ = ["CELLS", "Kernel", "measure_cells"]

#: The timed cells: case -> (spmd's cell, ipyparallel's cell).
CELLS = {
    "a plain cell (the kernel's own round trip)": ("x = 1", "x = 1"),
    "%%spmd cell: x = 1": ("%%spmd\nx = 1", "%%px\nx = 1"),
    "%%spmd cell: all_reduce of 8 float64": ("%%spmd\nr = comm.all_reduce(np.ones(8))",
                                             "%%px\ncomm.Allreduce(np.ones(8), r)"),
}

_IPP_START = """\
import ipyparallel as ipp
_cluster = ipp.Cluster(n={n}, engines="mpi", log_level=40)
_rc = _cluster.start_and_connect_sync()
_rc.wait_for_engines({n}, timeout=120)
_rc[:].activate()
"""
_IPP_SETUP = "%%px\nfrom mpi4py import MPI\nimport numpy as np\ncomm = MPI.COMM_WORLD\nr = np.empty(8)"


class Kernel:
    """A kernel started as Jupyter starts one, with env; cell(code) -> (status, [(kind, content)]).

    Also the driver of the magic's tests (tests/interactive/test_magic.py).
    """

    def __init__(self, env: dict[str, str] | None = None) -> None:
        from jupyter_client.manager import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=dict(os.environ) if env is None else env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def cell(self, code: str, interrupt_after: float | None = None,
             timeout: float = 90) -> tuple[str, list[tuple[str, Any]]]:
        """Run code; return the reply's status and its outputs: stream text, display data, error tracebacks."""
        msg_id = self.kc.execute(code)
        if interrupt_after is not None:
            time.sleep(interrupt_after)
            self.km.interrupt_kernel()
        out: list[tuple[str, Any]] = []
        while True:
            msg = self.kc.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(("stream", content["text"]))
            elif kind in ("execute_result", "display_data"):
                out.append((kind, content["data"]))
            elif kind == "error":
                out.append(("error", "\n".join(content["traceback"])))
            elif kind == "status" and content["execution_state"] == "idle":
                break
        while True:
            reply = self.kc.get_shell_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"]["status"], out

    def text(self, code: str, **kw: Any) -> tuple[str, str]:
        """The status and the outputs as text (a display's text/plain)."""
        status, out = self.cell(code, **kw)
        return status, "".join(c if isinstance(c, str) else c.get("text/plain", "") + "\n" for _, c in out)

    def must(self, code: str) -> str:
        """The outputs' text of a cell that must succeed."""
        status, text = self.text(code)
        if status != "ok":
            raise BenchError(f"the kernel failed a cell:\n{code}\n{text[-2000:]}")
        return text

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def measure_cells(ranks: int = 4, repeats: int = 20) -> dict[str, dict[str, list[float]]]:
    """Seconds of every cell of every case, by tool, interleaved: a kernel for each tool, both alive throughout
    (in one kernel, the ipyparallel client's threads would slow spmd's cells too)."""
    times: dict[str, dict[str, list[float]]] = {case: {"spmd": [], "ipyparallel": []} for case in CELLS}
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # the wheel's mpiexec
    kernels = {"spmd": Kernel(env), "ipyparallel": Kernel(env)}
    try:
        kernels["spmd"].must(f"%load_ext spmd\n%spmd start -n {ranks}")
        kernels["spmd"].must("%%spmd\nimport numpy as np")
        kernels["ipyparallel"].must(_IPP_START.format(n=ranks))
        kernels["ipyparallel"].must(_IPP_SETUP)
        for _ in range(3):  # warm both
            for spmd_cell, ipp_cell in CELLS.values():
                kernels["spmd"].must(spmd_cell), kernels["ipyparallel"].must(ipp_cell)
        for i in range(repeats):
            for case, cells in CELLS.items():
                order = (("spmd", cells[0]), ("ipyparallel", cells[1]))
                for tool, code in order if i % 2 == 0 else order[::-1]:
                    began = time.perf_counter()
                    kernels[tool].must(code)
                    times[case][tool].append(time.perf_counter() - began)
        want = [float(ranks)] * 8
        spmd_sum = kernels["spmd"].must("_pulled = %spmd pull r\nprint(sorted({str(a.tolist()) for a in _pulled}))")
        if spmd_sum.strip() != str([str(want)]):
            raise BenchError(f"spmd's all_reduce in the kernel gave {spmd_sum.strip()}")
        ipp_sum = kernels["ipyparallel"].must("print(_rc[0]['r'].tolist())")
        if ipp_sum.strip() != str(want):
            raise BenchError(f"mpi4py's Allreduce under %px gave {ipp_sum.strip()}")
    finally:
        for tool, bye in (("spmd", "%spmd stop"), ("ipyparallel", "_rc.close()\n_cluster.stop_cluster_sync()")):
            try:
                kernels[tool].cell(bye, timeout=60)
            finally:
                kernels[tool].close()
    return times
