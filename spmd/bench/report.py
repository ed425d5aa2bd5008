"""Tables, ratios, JSON and the plot, from the benchmark's rows."""

import json
import math
import os
import platform
import sys
import time

import numpy as np

from spmd.util.atomic import atomic_path, atomic_write
from spmd.errors import BenchError
from spmd.bench.cases import ALL, COLLECTIVES
from spmd.bench.measure import format_size
from spmd.bench.communicators import IMPLS

__all__ = [
    "SCHEMA",
    "PAIRS",
    "BANDS",
    "meta",
    "table",
    "ratios",
    "summary",
    "summary_table",
    "document",
    "write_json",
    "plot",
]

SCHEMA = "spmd-bench/1"
#: (spmd implementation, the raw one it wraps)
PAIRS = (("spmd-mpi", "mpi4py"), ("spmd-gloo", "gloo"), ("spmd-mpi+equal", "mpi4py"), ("spmd-gloo+equal", "gloo"),
         ("spmd-mpi", "mpi4py+pickle"))
#: Size bands of the summary: (name, lowest bytes, highest bytes exclusive).
BANDS = (("< 1 KiB", 0, 1 << 10), ("1 KiB - 1 MiB", 1 << 10, 1 << 20), (">= 1 MiB", 1 << 20, math.inf))


def meta(world, settings, started, argv=None, load_start=None, thp_env_start=None):
    """Describe the machine, the software and the settings of a run."""
    import numpy

    info = {
        "ranks": world.size,
        "hosts": sorted(set(world.placement.hosts)) or [platform.node()],
        "launcher": world.placement.launcher,
        "cpus": os.cpu_count(),
        "torch_threads": world.threads,
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "load_average_start": load_start,
        "load_average_end": list(os.getloadavg()),
        "transparent_hugepage": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"),  # spmd.init may set it
        "THP_MEM_ALLOC_ENABLE_given": thp_env_start,
        "command": " ".join(argv if argv is not None else sys.argv),
        "settings": {
            "collectives": list(settings.collectives),
            "sizes": list(settings.sizes),
            "impls": list(settings.impls or world.impls),
            "rounds": settings.rounds,
            "target_s": settings.target,
            "many": list(settings.many),
        },
    }
    from spmd import __version__

    info["spmd"] = __version__
    if "torch" in sys.modules:
        info["torch"] = sys.modules["torch"].__version__
    if world.mpi is not None:
        import mpi4py
        from mpi4py import MPI

        info["mpi4py"] = mpi4py.__version__
        info["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0]
    return info


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _index(rows):
    return {(r["collective"], r["impl"], r["size"]): r for r in rows}


def _impls(rows, collective):
    seen = []
    for r in rows:
        if r["collective"] == collective and r["impl"] not in seen:
            seen.append(r["impl"])
    order = {name: i for i, name in enumerate(IMPLS)}
    return sorted(seen, key=lambda i: (order.get(i.split("+")[0], 99), i))


def _fmt_us(us):
    if us >= 1e5:
        return f"{us / 1e3:.0f}ms"
    if us >= 1e4:
        return f"{us / 1e3:.1f}ms"
    return f"{us:.1f}" if us < 100 else f"{us:.0f}"


def table(rows, spread=False):
    """Return the terminal tables, one per collective: median us and busbw GB/s per implementation."""
    out = []
    idx = _index(rows)
    for collective in [c for c in ALL if any(r["collective"] == c for r in rows)]:
        impls = _impls(rows, collective)
        sizes = sorted({r["size"] for r in rows if r["collective"] == collective})
        ranks = next(r["ranks"] for r in rows if r["collective"] == collective)
        pairs = [(a, b) for a, b in PAIRS if a in impls and b in impls]
        what = "median us [p10-p90]" if spread else "median us"
        out.append(f"== {collective}  ({ranks} ranks; {what}, busbw GB/s) ==")
        width = max([24 if spread else 16] + [len(i) + 2 for i in impls])
        head = f"{'size':>9} " + "".join(f"{i:>{width}}" for i in impls)
        head += "".join(f"{a.split('-')[1] + ' x':>12}" for a, _ in pairs)
        out.append(head)
        for size in sizes:
            line = f"{format_size(size):>9} "
            for impl in impls:
                r = idx.get((collective, impl, size))
                if r is None:
                    line += f"{'-':>{width}}"
                    continue
                cell = _fmt_us(r["time_us"])
                if spread:
                    cell += f" [{_fmt_us(r['p10_us'])}-{_fmt_us(r['p90_us'])}]"
                line += f"{cell + ' ' + _fmt_bw(r['busbw_gbps']):>{width}}"
            for a, b in pairs:
                ra, rb = idx.get((collective, a, size)), idx.get((collective, b, size))
                line += f"{ra['time_us'] / rb['time_us']:>11.2f}x" if ra and rb else f"{'-':>12}"
            out.append(line)
        out.append("")
    return "\n".join(out)


def _fmt_bw(gbps):
    return f"{gbps:.2f}" if gbps >= 0.01 else f"{gbps:.1e}"


def ratios(rows, a, b, collective=None):
    """Return [(collective, size, time a / time b, us added by a)] where both were measured."""
    idx = _index(rows)
    out = []
    for (c, impl, size), ra in sorted(idx.items(), key=lambda kv: (kv[0][0], kv[0][2])):
        if impl != a or (collective and c != collective):
            continue
        rb = idx.get((c, b, size))
        if rb:
            out.append((c, size, ra["time_us"] / rb["time_us"], ra["time_us"] - rb["time_us"]))
    return out


def _band(size):
    return next(name for name, lo, hi in BANDS if lo <= size < hi)


def summary(rows):
    """Return the ratios the issue asks about, per collective and size band.

    wrapper: spmd vs the raw implementation it wraps; best: spmd's
    faster backend vs the faster raw one; uneven: uneven vs even chunks
    of the same bytes, per implementation; coalesce: one call per
    tensor vs the flattened list, per implementation.
    """
    out = {"wrapper": [], "best": [], "uneven": [], "coalesce": []}
    idx = _index(rows)
    for a, b in PAIRS:
        for c in ALL:
            out["wrapper"] += _banded(ratios(rows, a, b, c), {"spmd": a, "raw": b, "collective": c})
    for c in COLLECTIVES:
        best = []
        for size in sorted({r["size"] for r in rows if r["collective"] == c}):
            spmd = [idx[k]["time_us"] for k in ((c, "spmd-mpi", size), (c, "spmd-gloo", size)) if k in idx]
            raw = [idx[k]["time_us"] for k in ((c, "mpi4py", size), (c, "gloo", size)) if k in idx]
            if spmd and raw:
                best.append((c, size, min(spmd) / min(raw), min(spmd) - min(raw)))
        out["best"] += _banded(best, {"collective": c})
    for even in ("scatter", "gather"):
        for impl in IMPLS:
            pairs = []
            for size in sorted({r["size"] for r in rows}):
                u, e = idx.get((even + "_uneven", impl, size)), idx.get((even, impl, size))
                if u and e:
                    pairs.append((even, size, u["time_us"] / e["time_us"], u["time_us"] - e["time_us"]))
            out["uneven"] += _banded(pairs, {"collective": even, "impl": impl})
    for r in rows:
        if r["collective"] == "all_reduce_many" and r["impl"].endswith("+coalesce"):
            loop = idx.get(("all_reduce_many", r["impl"].split("+")[0], r["size"]))
            if loop:
                out["coalesce"].append({"impl": loop["impl"], "bytes": r["bytes"],
                                        "loop_us": loop["time_us"], "coalesced_us": r["time_us"],
                                        "speedup": loop["time_us"] / r["time_us"]})
    return out


def _banded(triples, labels):
    out = []
    for name, _, _ in BANDS:
        sel = [t for t in triples if _band(t[1]) == name]
        if not sel:
            continue
        rs, adds = [t[2] for t in sel], [t[3] for t in sel]
        out.append(dict(labels, band=name, sizes=len(sel),
                        median_ratio=float(np.median(rs)), max_ratio=max(rs),
                        median_added_us=float(np.median(adds)), max_added_us=max(adds)))
    return out


def summary_table(summ):
    """Return the summary as text."""
    lines = ["== spmd vs raw: time ratio (median, max) and us added (median, max) per size band =="]
    lines.append(f"{'collective':<16}{'spmd / raw':<28}{'band':<15}{'ratio':>7}{'max':>7}{'+us':>9}{'max':>9}")
    for s in summ["wrapper"]:
        lines.append(_sline(s["collective"], f"{s['spmd']} / {s['raw']}", s))
    for s in summ["best"]:
        lines.append(_sline(s["collective"], "best spmd / best raw", s))
    if summ["uneven"]:
        lines += ["", "== uneven / even chunks of the same bytes =="]
        for s in summ["uneven"]:
            lines.append(_sline(s["collective"], s["impl"], s))
    if summ["coalesce"]:
        lines += ["", "== all_reduce of a list: one call per tensor vs coalesced =="]
        for s in summ["coalesce"]:
            lines.append(f"{s['impl']:<12}{format_size(s['bytes']):>10}  one call per tensor {s['loop_us']:>9.0f} us"
                         f"  coalesced {s['coalesced_us']:>8.0f} us  speedup {s['speedup']:.1f}x")
    return "\n".join(lines)


def _sline(collective, what, s):
    return (f"{collective:<16}{what:<28}{s['band']:<15}{s['median_ratio']:>7.2f}{s['max_ratio']:>7.2f}"
            f"{s['median_added_us']:>9.1f}{s['max_added_us']:>9.1f}")


def document(rows, info, startup=None):
    """Return the JSON document: schema, method, meta, rows, summary (and start-up)."""
    from spmd.bench.measure import __doc__ as method

    doc = {"schema": SCHEMA, "method": method.strip(), "meta": info, "rows": rows,
           "summary": summary(rows) if rows else None}
    if startup is not None:
        doc["startup"] = startup
    return doc


def write_json(path, doc):
    """Write doc to path as indented JSON, atomically (spmd.util.atomic)."""
    with atomic_write(path, text=True) as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


_STYLE = {
    "spmd-mpi": ("tab:blue", "-", "o"),
    "mpi4py": ("tab:blue", "--", "x"),
    "mpi4py-torchbuf": ("tab:green", ":", "^"),
    "mpi4py+pickle": ("tab:cyan", "--", "v"),
    "spmd-gloo": ("tab:orange", "-", "o"),
    "gloo": ("tab:orange", "--", "x"),
    "spmd-mpi+equal": ("tab:purple", "-", "s"),
    "spmd-gloo+equal": ("tab:red", "-", "s"),
}


def plot(rows, path, title=None):
    """Draw busbw against size, one panel per collective, one line per implementation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError as exc:
        raise BenchError(
            f"plotting needs matplotlib ({exc}); install it with: pip install matplotlib, "
            "or leave out --plot"
        ) from None
    panels = [c for c in ALL if c != "all_reduce_many" and any(r["collective"] == c for r in rows)]
    if not panels:
        raise BenchError("nothing to plot: no collective was measured at several sizes")
    cols = min(3, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for ax, collective in zip(axes.flat, panels):
        for impl in _impls(rows, collective):
            pts = sorted((r["bytes"], r["busbw_gbps"]) for r in rows
                         if r["collective"] == collective and r["impl"] == impl)
            color, style, marker = _STYLE.get(impl, (None, "-", "."))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, marker=marker,
                    markersize=3, linewidth=1.2, label=impl)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_size(int(v)).replace(" ", "")))
        ax.set_yscale("log")
        ax.set_title(collective, fontsize=10)
        ax.set_xlabel("bytes", fontsize=8)
        ax.set_ylabel("busbw GB/s", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=80)
        plt.close(fig)
        from PIL import Image  # matplotlib depends on Pillow

        with Image.open(tmp) as image:  # a 64-colour palette: a third of the bytes
            small = image.convert("RGB").quantize(64)
        small.save(tmp, format="PNG", optimize=True)
