"""``compress="auto"``: measure the link and the compression's own cost, then choose each gradient's form.

For its first :data:`MEASURE_STEPS` optimizer steps a DataParallel with
``compress="auto"`` sends the gradients it decides uncompressed (they are
also PowerSGD's warm-up).  After the last of them, in ``synchronize``,
:func:`measure` times, on every rank, all_reduces of two sizes (a latency
and a time per byte: the link as the collectives see it), a bf16 cast of the
buckets' size, and PowerSGD's matrix products on the gradients at hand.  The
ranks gather the timings and take each one's slowest; rank 0 runs
:func:`choose` (pure: tests feed it slow and fast links) and broadcasts the
choice, so every rank takes the same.  :func:`summary` is the line rank 0
says once.  docs/training.md gives the rule and the measurements.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from spmd.train.powersgd import DEFAULT_RANK, compressible, orthonormalize, times_q, transposed_times_p

if TYPE_CHECKING:
    from spmd.comms.comm import Comm

__all__ = ["AUTO", "MEASURE_STEPS", "MARGIN", "MIN_GAIN_S", "Link", "Costs", "Candidate", "choose", "measure",
           "summary", "say"]

#: The name of this form in ``compress``.
AUTO = "auto"

#: Optimizer steps sent uncompressed before the choice (the first includes one-time costs: not timed).
MEASURE_STEPS = 3

#: A compressed choice must save at least this part of the uncompressed communication time ...
MARGIN = 0.25
#: ... and at least this many seconds a step; otherwise everything travels uncompressed.
MIN_GAIN_S = 0.002

#: The forms auto chooses among.
POWERSGD_FORM = f"powersgd:{DEFAULT_RANK}"
FORMS = (None, "bf16", POWERSGD_FORM)

#: Elements of the large probe all_reduce, at most (4 MB in float32: 0.2 s at 200 Mbit/s), and of the small one.
_LARGE = 1 << 20
_SMALL = 256
_LARGE_AT_LEAST = 256 << 10  # 1 MB: the time per byte above the noise of the latency
_REPEATS = 5


@dataclass(frozen=True)
class Link:
    """An all_reduce of b bytes takes latency_s + s_per_byte * b (its ring's traffic included)."""

    latency_s: float
    s_per_byte: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + self.s_per_byte * nbytes

    @property
    def mb_per_s(self) -> float:
        return 1 / self.s_per_byte / 1e6 if self.s_per_byte > 0 else float("inf")


@dataclass(frozen=True)
class Candidate:
    """A gradient auto may compress: its name, its elements, and as PowerSGD factors (None: not a matrix worth it)."""

    name: str
    numel: int
    factor_numel: int | None = None


@dataclass(frozen=True)
class Costs:
    """What compression costs here: seconds per float32 byte cast to bf16 and back; PowerSGD's seconds per matrix."""

    cast_s_per_byte: float
    powersgd_s: dict[str, float]


def choose(link: Link, costs: Costs, candidates: list[Candidate], margin: float = MARGIN,
           min_gain_s: float = MIN_GAIN_S) -> tuple[dict[str, str | None], float, float]:
    """Return ({name: form}, seconds a step uncompressed, seconds with the choice): pure, the same on every rank.

    Each gradient takes the form of least time: uncompressed, 4 bytes an
    element on the link; bf16, 2 bytes plus the cast; powersgd:4, its
    factors' 4 bytes an element plus its measured products.  The choice
    pays a latency per extra all_reduce (bf16's bucket, PowerSGD's two).
    Unless it saves margin of the uncompressed time and min_gain_s,
    everything travels uncompressed: on a fast link auto never loses.
    """
    plain = link.seconds(4 * sum(c.numel for c in candidates)) if candidates else 0.0
    out, chosen = {}, 0.0
    for c in candidates:
        times = {None: link.s_per_byte * 4 * c.numel,
                 "bf16": (link.s_per_byte * 2 + costs.cast_s_per_byte * 4) * c.numel}
        if c.factor_numel is not None and c.name in costs.powersgd_s:
            times[POWERSGD_FORM] = link.s_per_byte * 4 * c.factor_numel + costs.powersgd_s[c.name]
        form = min(times, key=lambda f: (times[f], FORMS.index(f)))
        out[c.name] = form
        chosen += times[form]
    forms = set(out.values())
    chosen += link.latency_s * ((None in forms) + ("bf16" in forms) + 2 * (POWERSGD_FORM in forms))
    if not candidates or plain - chosen < max(margin * plain, min_gain_s):
        return {c.name: None for c in candidates}, plain, plain
    return out, plain, chosen


def _timed(fn, repeats=_REPEATS) -> float:
    """The least seconds of fn() over repeats, after one untimed call (the least: others' load on shared cores is noise)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _powersgd_seconds(p: torch.Tensor, rank: int) -> float:
    """Seconds PowerSGD's local work takes on p's gradient: M Q, orthonormalize, M^T P, P Q^T, E's two passes."""
    g = p.grad if p.grad is not None and not p.grad.is_sparse else torch.zeros_like(p)
    m = g.detach().reshape(p.shape[0], -1).clone()
    q = torch.randn(m.shape[1], rank, generator=torch.Generator().manual_seed(0), dtype=m.dtype)

    def work():
        m.add_(g.reshape(m.shape), alpha=1.0)
        pp = orthonormalize(times_q(m, q))
        qq = transposed_times_p(m, pp)
        m.sub_(pp @ qq.T)

    return _timed(work, 2)


def measure(comm: Comm, named: list[tuple[str, torch.nn.Parameter]]) -> tuple[Link, Costs]:
    """Time the link and the compressions here, and take every rank's slowest: a collective, the same everywhere.

    named: the gradients auto chooses for, alike on every rank.
    """
    total = sum(p.numel() for _, p in named)
    large = torch.zeros(max(_LARGE_AT_LEAST, min(total, _LARGE)))
    small = torch.zeros(_SMALL)
    t_small = _timed(lambda: comm.all_reduce(small))
    t_large = _timed(lambda: comm.all_reduce(large), repeats=3)
    src = torch.randn(large.numel(), generator=torch.Generator().manual_seed(0))
    wire = torch.empty(large.numel(), dtype=torch.bfloat16)
    cast = _timed(lambda: (wire.copy_(src), src.copy_(wire))) / (4 * src.numel())
    psgd = {n: _powersgd_seconds(p, DEFAULT_RANK) for n, p in named if compressible(p, DEFAULT_RANK)}
    mine = [t_small, t_large, cast, [psgd[n] for n in sorted(psgd)]]
    everyone = comm.all_gather_object(mine)
    t_small, t_large, cast = (max(r[i] for r in everyone) for i in range(3))
    slowest = [max(r[3][i] for r in everyone) for i in range(len(psgd))]
    per_byte = max(t_large - t_small, 0.0) / (4 * (large.numel() - small.numel()))
    link = Link(latency_s=max(t_small - per_byte * 4 * small.numel(), 0.0), s_per_byte=per_byte)
    return link, Costs(cast, dict(zip(sorted(psgd), slowest)))


def summary(choice: dict[str, str | None], numel: dict[str, int], link: Link, plain_s: float,
            chosen_s: float) -> str:
    """The line rank 0 says once: what travels how, and why."""
    parts = []
    for form in FORMS:
        names = [n for n, f in choice.items() if f == form]
        if names:
            mb = sum(numel[n] for n in names) * 4 / 2**20
            some = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            parts.append(f"{form or 'none'} for {len(names)} ({mb:.3g} MB: {some})")
    speed = (f"{link.mb_per_s:.0f} MB/s" if link.s_per_byte > 0 else "bytes too fast to time")
    return (f"spmd: DataParallel compress='auto' chose {'; '.join(parts)}; measured all_reduce "
            f"{link.latency_s * 1e3:.2f} ms + {speed}: about {plain_s * 1e3:.1f} ms of communication a step "
            f"uncompressed, {chosen_s * 1e3:.1f} ms as chosen")


def say(rank: int, line: str) -> None:
    """Write line to stderr on rank 0 only."""
    if rank == 0:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
