"""Extra memory of one large all_reduce, whole and in chunks (the guide's 5.2).

For each backend and each way (one call, then ``chunk_bytes``), every rank
resets its peak resident size (Linux: writing 5 to ``/proc/self/clear_refs``),
runs the all_reduce on a buffer it has already written, and reads the peak
back: the peak minus the resident size before the call is the memory the
call added, the backend's scratch space and any copies.  Reported per
case: the largest over the ranks.
"""

import gc

from spmd.errors import BenchError

__all__ = ["available", "measure", "memory_table"]

_STATUS = "/proc/self/status"


def _kib(field):
    with open(_STATUS) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise BenchError(f"{field} missing from {_STATUS}")


def available():
    """Tell whether this system can reset and read a process's peak memory."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _kib("VmHWM")
    except OSError:
        return False
    return True


def _extra_kib(run):
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from the current resident size
    before = _kib("VmRSS")
    run()
    return max(_kib("VmHWM") - before, 0)


def measure(world, nbytes, chunk_bytes):
    """Return one row per (backend, whole or chunked): the extra KiB of the worst rank."""
    import torch

    rows = []
    for backend, comm in (("mpi", world.spmd_mpi), ("gloo", world.spmd_gloo)):
        if comm is None:
            continue
        x = torch.ones(nbytes // 4)  # written, so its pages are resident before the call
        for chunk in (None, chunk_bytes):
            comm.barrier()
            extra = _extra_kib(lambda: comm.all_reduce(x, chunk_bytes=chunk))
            worst = max(comm.all_gather_object(extra))
            ok = bool(float(x[0]) == float(world.size) ** (2 if chunk else 1))
            rows.append({"backend": backend, "bytes": nbytes, "chunk_bytes": chunk,
                         "extra_kib": worst, "correct": ok})
        x = None  # free it before the next backend
    return rows


def memory_table(rows):
    """Return the rows as text."""
    lines = ["== extra memory of one all_reduce (peak resident minus before; worst rank) ==",
             f"{'backend':<8}{'array':>10}{'chunk_bytes':>14}{'extra MiB':>12}{'extra / chunk':>15}{'result':>8}"]
    for r in rows:
        chunk = r["chunk_bytes"]
        ratio = f"{r['extra_kib'] * 1024 / chunk:.2f}x" if chunk else "-"
        chunk_text = f"{chunk / 2**20:g} MiB" if chunk else "none"
        lines.append(f"{r['backend']:<8}{r['bytes'] / 2**20:>6.0f} MiB{chunk_text:>14}"
                     f"{r['extra_kib'] / 1024:>12.1f}{ratio:>15}{'ok' if r['correct'] else 'WRONG':>8}")
    return "\n".join(lines)
