"""Cells in a real Jupyter kernel: ``%%spmd`` beside ipyparallel's ``%%px``, timed as a notebook waits for them.

Two kernels (ipykernel, started and driven by jupyter_client as Jupyter
does), both alive throughout: one with ``%spmd start -n RANKS``, one with an
ipyparallel Cluster of RANKS mpiexec engines and ``%px`` activated.  A cell's time runs from the
execute request to the kernel's reply and its idle status, so the kernel's
own round trip is in both tools' times.  The cells alternate, medians of
REPEATS (the order of the two swapped every repeat): ``x = 1`` and an all-reduce of 8 float64 (``comm.all_reduce``
beside mpi4py's ``Allreduce``), each checked by its sum, and a plain ``x = 1`` cell, the kernel's own
round trip, in each kernel.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from spmd.errors import BenchError

__all__ = ["CELLS", "measure_cells"]

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


class _Kernel:
    """A kernel as Jupyter starts one; cell(code) waits for its reply and idle status, returns (status, text)."""

    def __init__(self) -> None:
        from jupyter_client.manager import KernelManager

        env = dict(os.environ)
        bin_dir = os.path.dirname(sys.executable)  # the mpich wheel's mpiexec, for engines="mpi"
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def cell(self, code: str, timeout: float = 180) -> tuple[str, str]:
        msg_id = self.kc.execute(code)
        text, idle, status = [], False, None
        while not idle or status is None:
            if not idle:
                msg = self.kc.get_iopub_msg(timeout=timeout)
                if msg["parent_header"].get("msg_id") == msg_id:
                    kind, content = msg["msg_type"], msg["content"]
                    if kind == "stream":
                        text.append(content["text"])
                    elif kind in ("execute_result", "display_data"):
                        text.append(content["data"].get("text/plain", "") + "\n")
                    elif kind == "error":
                        text.append("\n".join(content["traceback"]))
                    idle = kind == "status" and content["execution_state"] == "idle"
            else:
                reply = self.kc.get_shell_msg(timeout=timeout)
                if reply["parent_header"].get("msg_id") == msg_id:
                    status = reply["content"]["status"]
        return status, "".join(text)

    def must(self, code: str) -> str:
        status, text = self.cell(code)
        if status != "ok":
            raise BenchError(f"the kernel failed a cell:\n{code}\n{text[-2000:]}")
        return text

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def measure_cells(ranks: int = 4, repeats: int = 20) -> dict[str, dict[str, list[float]]]:
    """Seconds of every cell of every case, by tool, interleaved: a kernel for each tool, both alive throughout
    (the ipyparallel client's threads in one kernel slowed the other tool's cells there by 2-6 ms)."""
    times: dict[str, dict[str, list[float]]] = {case: {"spmd": [], "ipyparallel": []} for case in CELLS}
    kernels = {"spmd": _Kernel(), "ipyparallel": _Kernel()}
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
