"""How a point is timed, and the sweep over collectives, sizes and rounds.

nccl-tests' loop with OSU's max over ranks: a warm-up fixes the calls per
sample; a sample is a barrier then k back-to-back calls, the slowest rank's
time divided by k; every implementation takes its turn per size in an order
rotated each round; reported are the median and p10/p90 of all samples,
algbw and busbw.  Each implementation's result is checked before it is timed.
The whole method: docs/bench.md.
"""

import gc
import math
import time
from dataclasses import dataclass, field

import numpy as np

from spmd.errors import BenchArgumentError
from spmd.util.units import format_size, parse_size
from spmd.bench.cases import ALL, BUSBW, COLLECTIVES, EXTRAS, Layout, build, check, impls_for

__all__ = [
    "Settings",
    "run",
    "layout",
    "parse_size",
    "format_size",
    "default_sizes",
    "huge_pages",
]

BLOCK_S = 0.002  # a sample's length when calls are short
WARMUP_S = 0.01
MIN_SAMPLES, MAX_SAMPLES, MAX_CALLS = 2, 200, 100_000
def default_sizes(min_size=8, max_size=256 << 20, factor=4):
    """Return min_size, the powers of factor above it up to max_size, and max_size.

    The default, 8 B, 16 B, 64 B, ... 256 MiB, lands on 1 KiB and 1 MiB.
    """
    if min_size < 1 or max_size < min_size or factor < 2:
        raise BenchArgumentError(f"need 1 <= min ({min_size}) <= max ({max_size}) and factor >= 2")
    out, s = [min_size], 1
    while s <= max_size:
        if s > min_size:
            out.append(s)
        s *= factor
    if out[-1] != max_size:
        out.append(max_size)
    return tuple(out)


@dataclass
class Settings:
    """What to measure.  target: seconds per implementation, size and round."""

    collectives: tuple = COLLECTIVES + EXTRAS
    sizes: tuple = field(default_factory=default_sizes)
    impls: tuple = None  # None: every one the world has
    rounds: int = 3
    target: float = 0.1
    many: tuple = (200, 4096)  # all_reduce_many: tensors, bytes each
    verify: bool = True
    clock: str = "wall"  # "cpu": this process's CPU time, meaningful only in a world of one


def layout(collective, nbytes, size, many=(200, 4096)):
    """Return the Layout measured for collective at nominal nbytes, or None to skip."""
    if collective == "all_reduce_many":
        return Layout(elems=max(1, many[1] // 4), count=many[0])
    if collective in ("pingpong", "sendrecv"):
        return Layout(elems=max(1, nbytes // 4)) if size > 1 else None  # nobody to talk to
    if collective in ("broadcast", "reduce", "all_reduce"):
        return Layout(elems=max(1, nbytes // 4))
    if collective.endswith("_uneven"):
        # rank r gets r+1 units: the last rank gets size times the first one's share.
        unit = nbytes // 4 // (size * (size + 1) // 2)
        return Layout(lengths=tuple(unit * (r + 1) for r in range(size))) if unit else None
    return Layout(lengths=(max(1, nbytes // 4 // size),) * size)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _samples(world, op, calls, count, clock=time.perf_counter):
    """Return count samples (slowest rank's seconds per call over calls back-to-back calls)."""
    out = []
    for _ in range(count):
        world.barrier()
        t0 = clock()
        for _ in range(calls):
            op()
        out.append((clock() - t0) / calls)
    return world.max(out)


def _plan(world, op, target, clock):
    """Warm op up; return (calls per sample, samples per round, estimated seconds per call)."""
    first = _samples(world, op, 1, 1, clock)[0]
    warm = max(1, min(1000, math.ceil(WARMUP_S / max(first, 1e-7))))
    per_call = max(_samples(world, op, warm, 1, clock)[0], 1e-8)
    calls = max(1, min(MAX_CALLS, math.ceil(min(BLOCK_S, target / 10) / per_call)))
    samples = max(MIN_SAMPLES, min(MAX_SAMPLES, round(target / (calls * per_call))))
    return calls, samples, per_call


def huge_pages(buffer):
    """Return (AnonHugePages kB, size kB) of the memory mappings that hold buffer, or None.

    Summed over every mapping the buffer overlaps: numpy's madvise splits
    a large allocation into an unaligned head and a huge-page-eligible body.
    """
    if buffer is None:
        return None
    if hasattr(buffer, "data_ptr"):
        start, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    else:
        start, nbytes = buffer.__array_interface__["data"][0], buffer.nbytes
    end, huge, size, inside = start + max(nbytes, 1), 0, 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if not head.endswith(":"):
                    lo, hi = (int(v, 16) for v in head.split("-"))
                    inside = lo < end and start < hi
                    size += (hi - lo) // 1024 if inside else 0
                elif inside and head == "AnonHugePages:":
                    huge += int(line.split()[1])
    except (OSError, ValueError):
        return None
    return (huge, size) if size else None


def _row(collective, impl, nbytes, lay, ranks, samples, calls, probe):
    t = np.asarray(samples)
    median = float(np.median(t))
    algbw = lay.nbytes / median / 1e9
    row = {
        "collective": collective,
        "impl": impl,
        "size": nbytes,
        "bytes": lay.nbytes,
        "ranks": ranks,
        "time_us": median * 1e6,
        "p10_us": float(np.percentile(t, 10)) * 1e6,
        "p90_us": float(np.percentile(t, 90)) * 1e6,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * BUSBW(collective, ranks),
        "calls_per_sample": calls,
        "samples": len(t),
    }
    if probe is not None:
        row["huge_pages_kb"], row["mapping_kb"] = probe
    return row


def _verify(world, collective, impls):
    """Run each implementation once on small filled buffers and check the result."""
    n = world.size
    lay = layout(collective, 24 * n * (n + 1), n, (3, 20))
    for impl in impls:
        case = build(world, collective, impl, lay, fill=True)
        case.op()
        check(case, collective, lay, world.rank, world.size, impl)
    world.barrier()


def _sweep(world, collective, impls, sizes, settings, progress):
    clock = CLOCKS[settings.clock]
    rows = []
    for nbytes in sizes:
        lay = layout(collective, nbytes, world.size, settings.many)
        if lay is None:
            continue
        cases = {impl: build(world, collective, impl, lay) for impl in impls}
        plans, times = {}, {impl: [] for impl in impls}
        for rnd in range(settings.rounds):
            order = impls[rnd % len(impls):] + impls[: rnd % len(impls)]
            for impl in order:
                op = cases[impl].op
                if impl not in plans:
                    plans[impl] = _plan(world, op, settings.target, clock)
                else:
                    calls, _, per_call = plans[impl]
                    if per_call < 0.05:
                        _samples(world, op, max(1, calls // 10), 1, clock)
                calls, count, _ = plans[impl]
                times[impl] += _samples(world, op, calls, count, clock)
        for impl in impls:
            probe = huge_pages(cases[impl].buffer) if lay.nbytes >= 1 << 20 else None
            row = _row(collective, impl, nbytes, lay, world.size, times[impl], plans[impl][0], probe)
            rows.append(row)
            if progress:
                progress(row)
        del cases
        gc.collect()
    return rows


def run(world, settings=None, progress=None):
    """Measure every collective, size and implementation; return the rows.

    Every rank must call run with the same settings; every rank gets
    the same rows.  progress(row), if given, is called as rows finish.
    """
    settings = settings or Settings()
    rows = []
    for collective in settings.collectives:
        if collective not in ALL:
            raise BenchArgumentError(f"unknown collective {collective!r}; expected one of {ALL}")
        wanted = settings.impls or world.impls
        impls = tuple(i for i in impls_for(collective, wanted) if _available(world, i))
        if settings.verify:
            _verify(world, collective, impls)
        sizes = settings.sizes if collective != "all_reduce_many" else (settings.many[0] * settings.many[1],)
        rows += _sweep(world, collective, impls, sizes, settings, progress)
    return rows


def _available(world, impl):
    base = impl.split("+")[0]
    if base.startswith("mpi4py") or base == "spmd-mpi":
        return world.mpi is not None
    return world.spmd_gloo is not None
