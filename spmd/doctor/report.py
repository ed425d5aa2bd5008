"""The doctor's report: one JSON-able value, and its text (a table of hosts, a matrix of pairs, findings).

``as_json`` keeps the keys docs/doctor.md promises: ``hosts`` (host, address, interface, resolves_to,
versions, clock_offset_s, warnings), ``pairs`` (a, b, ok, error, connect_ms, mbps), ``collectives``,
``findings`` and ``ok``; ``met_at`` and ``seconds``, when the ranks met (CLOCK_MONOTONIC on rank 0's
host) and how long the checks took from there.  ``as_text`` is what rank 0 prints without ``--json``.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from spmd.doctor.judge import Finding, blocks

__all__ = ["Report", "as_json", "as_text"]

_HOST_KEYS = ("host", "address", "interface", "why", "interfaces", "resolves_to", "ranks", "versions",
              "clock_offset_s", "warnings", "errors")
_PAIR_KEYS = ("a", "b", "ok", "error", "connect_ms", "mbps", "address", "port", "interface")
_SHOWN_VERSIONS = ("python", "torch", "spmd", "mpi4py")


class Report:
    """What the doctor found: hosts, pairs of hosts, collectives (None: not run, and why), findings."""

    def __init__(self, launcher: str, size: int, hosts: Sequence[dict[str, Any]], pairs: Sequence[dict[str, Any]],
                 found: Sequence[Finding], collectives: Sequence[dict[str, Any]] | None = None,
                 skipped: str | None = None, met_at: float | None = None, seconds: float | None = None) -> None:
        self.launcher, self.size, self.hosts, self.pairs = launcher, size, list(hosts), list(pairs)
        self.found, self.collectives, self.skipped = list(found), collectives, skipped
        self.met_at, self.seconds = met_at, seconds  # when the ranks met (time.monotonic), and the checks' time
        for h in self.hosts:
            h["warnings"] = [f.text for f in self.found if f.level == "warning" and h["host"] in f.hosts]
            h["errors"] = [f.text for f in self.found if f.level == "error" and h["host"] in f.hosts]

    @property
    def ok(self) -> bool:
        """True when nothing found would stop a job."""
        return not blocks(self.found)


def as_json(report: Report) -> str:
    """The report as one JSON object."""
    return json.dumps({
        "ok": report.ok, "launcher": report.launcher, "ranks": report.size,
        "hosts": [{k: h.get(k) for k in _HOST_KEYS} for h in report.hosts],
        "pairs": [{k: p.get(k) for k in _PAIR_KEYS} for p in report.pairs],
        "collectives": report.collectives, "collectives_skipped": report.skipped,
        "findings": [f.as_dict() for f in report.found],
        "met_at": report.met_at, "seconds": report.seconds,
    }, indent=1)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _cell(pair: dict[str, Any] | None) -> str:
    if pair is None:
        return "?"
    if not pair["ok"]:
        return "FAILED: " + pair["error"].split(":")[0]
    text = f"ok {pair['connect_ms']:.1f} ms"
    return text + (f" {pair['mbps']:.0f} MB/s" if pair.get("mbps") else "")


def as_text(report: Report) -> str:
    """The report as rank 0 prints it."""
    names = [h["host"] for h in report.hosts]
    lines = [f"spmd doctor: {len(names)} host{'s' * (len(names) != 1)}, {report.size} rank"
             f"{'s' * (report.size != 1)}, started by {report.launcher}"
             + (f"; checked in {report.seconds:.1f} s from the ranks' meeting" if report.seconds is not None else "")]
    rows = [["host", "ranks", "address", "interface", "of", "resolves to", *_SHOWN_VERSIONS, "clock"]]
    for h in report.hosts:
        offset = h.get("clock_offset_s")
        rows.append([h["host"], ",".join(map(str, h["ranks"][:6])) + ("..." if len(h["ranks"]) > 6 else ""),
                     h.get("address") or "-", h.get("interface") or "-",
                     ",".join(dict.fromkeys(a["interface"] for a in h.get("interfaces") or ())) or "-",
                     ",".join(h.get("resolves_to") or []) or "-",
                     *[str(h["versions"].get(k) or "-") for k in _SHOWN_VERSIONS],
                     "-" if offset is None else f"{offset:+.3f} s"])
    lines += _table(rows)
    if len(names) > 1:
        by = {(p["a"], p["b"]): p for p in report.pairs}
        lines += ["", "connections, from each row's host to each column's (connect time, bandwidth):"]
        lines += _table([["from \\ to", *names]] +
                        [[a, *["-" if a == b else _cell(by.get((a, b))) for b in names]] for a in names])
    lines.append("")
    if report.collectives is not None:
        worked = ", ".join(f"{c['name']} {c['ms']:.1f} ms" for c in report.collectives if c["ok"])
        lines.append(f"collectives (one of each, 8 float32, on backend {report.collectives[0]['backend']}): {worked}"
                     if report.collectives else "collectives: none")
    else:
        lines.append(f"collectives: not run ({report.skipped})")
    errors = [f for f in report.found if f.level == "error"]
    warnings = [f for f in report.found if f.level == "warning"]
    for f in errors:
        lines.append(f"error: {f.text}")
    for fix in dict.fromkeys(f.fix for f in errors if f.fix):
        lines.append(f"  fix: {fix}")
    for f in warnings:
        lines.append(f"warning: {f.text}")
        lines += [f"  fix: {f.fix}"] if f.fix else []
    lines.append("ok: nothing found would stop a job" + (f" ({len(warnings)} warning{'s' * (len(warnings) != 1)})"
                                                         if warnings else "")
                 if report.ok else f"FAILED: {len(errors)} error{'s' * (len(errors) != 1)}: a job would fail here")
    return "\n".join(lines)
