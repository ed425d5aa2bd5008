"""What the ranks of a block said, merged into one text: each distinct line once, labelled with its ranks.

Output lines: where every rank that printed printed as many lines, line i
of each is shown once per distinct text, ``[0-3] 10.0`` or ``[0] 0`` then
``[1] 2``, in rank order; otherwise each rank's whole output once per
distinct text.  A value and a traceback are shown once per distinct text
with the ranks that gave it (spmd.util.words writes them).  Only the standard library.
"""

from __future__ import annotations

from typing import Any

from spmd.util.words import ranks_text, span

__all__ = ["merged", "render", "where_report"]


def _groups(texts: dict[int, str]) -> list[tuple[list[int], str]]:
    """Each distinct text with its ranks, in the order of each one's lowest rank."""
    by: dict[str, list[int]] = {}
    for rank in sorted(texts):
        by.setdefault(texts[rank], []).append(rank)
    return sorted(((ranks, text) for text, ranks in by.items()), key=lambda g: g[0][0])


def merged(texts: dict[int, str]) -> list[str]:
    """Lines of every rank's text, each distinct one once, prefixed with its ranks."""
    said = {r: t.rstrip("\n").split("\n") for r, t in texts.items() if t}
    if not said:
        return []
    out = []
    if len({len(lines) for lines in said.values()}) == 1:
        for i in range(len(next(iter(said.values())))):
            for ranks, line in _groups({r: lines[i] for r, lines in said.items()}):
                out.append(f"[{span(ranks)}] {line}")
        return out
    for ranks, text in _groups({r: "\n".join(lines) for r, lines in said.items()}):
        out += [f"[{span(ranks)}] {line}" for line in text.split("\n")]
    return out


def render(reply: dict[str, Any]) -> str:
    """The text a block's reply shows: output, errors' output, value, exceptions, then spmd's notes."""
    results: dict[int, dict[str, Any]] = reply.get("results", {})
    lines = merged({r: res.get("out") or "" for r, res in results.items()})
    lines += merged({r: res.get("err") or "" for r, res in results.items()})
    lines += merged({r: res["value"] for r, res in results.items() if res.get("value") is not None})
    errors = {r: res["error"] for r, res in results.items() if res.get("error")}
    for ranks, text in _groups(errors):
        lines += [f"[{span(ranks)}] {line}" for line in text.rstrip("\n").split("\n")]
    lines += [note for note in reply.get("notes", []) if note]
    return "\n".join(lines) + ("\n" if lines else "")


def where_report(said: dict[int, dict[str, Any]], stuck: list[int], done: list[int], why: str) -> str:
    """spmd's report of where every rank of a block is: one line per place, each distinct stack once."""
    places: dict[tuple[Any, ...], list[int]] = {}
    for rank in stuck:
        w = said.get(rank)
        key = ("?",) if w is None else (w.get("call"), w.get("where", "?"), w.get("func", "?"))
        places.setdefault(key, []).append(rank)
    lines = [f"spmd: {why}; where the ranks are:"]
    for key, ranks in sorted(places.items(), key=lambda kv: kv[1][0]):
        who = ranks_text(ranks, ranges=True)
        if key == ("?",):
            lines.append(f"  {who}: did not answer (busy in C code, without the GIL released?)")
        elif key[0]:
            lines.append(f"  {who}: waiting in {key[0]} at {key[1]}")
        else:
            lines.append(f"  {who}: at {key[1]} in {key[2]}()")
    if done:
        lines.append(f"  {ranks_text(done, ranges=True)}: finished")
    stacks = {r: w.get("stack", "") for r, w in said.items() if w.get("stack")}
    for ranks, stack in _groups(stacks):
        who = ranks_text(ranks, ranges=True)
        lines.append(f"  where {who} stood (innermost last):")
        lines += ["  " + line for line in stack.rstrip("\n").split("\n")]
    return "\n".join(lines)
