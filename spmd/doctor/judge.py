"""What the doctor's measurements mean, in words: pure functions from the report's parts to findings.

A finding is an error when a job would fail on it (a pair of hosts that cannot connect, a rank that
never reported, a version a job cannot mix, a collective that failed) and a warning when spmd works
round it or a job merely runs slower (a host whose name resolves to loopback, a skewed clock, a slow
link).  Each finding names its hosts and the fix.  docs/doctor.md lists them.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from spmd.doctor.facts import VERSIONS_THAT_BLOCK

__all__ = ["Finding", "findings", "pair_findings", "version_findings", "clock_findings", "link_findings",
           "name_findings", "silent_findings", "collective_findings", "blocks", "CLOCK_SKEW", "SLOW_LINK"]

#: Seconds of clock difference from rank 0's host worth a warning (traces, logs and credentials skew).
CLOCK_SKEW = 0.5
#: What to do about a pair of hosts that cannot connect.
PAIR_FIX = ("a job needs every pair of hosts to connect (gloo and MPI connect each pair): open the hosts' firewalls "
            "to each other (TCP, any port), or set SPMD_IFNAME to an interface on a network every host shares")
#: A host whose links run below this share of the other hosts' median is named as slow.
SLOW_LINK = 0.5
#: Versions only a job on the mpi backend cannot mix: elsewhere (srun --mpi=none, torchrun) a difference warns.
MPI_VERSIONS = ("mpi4py", "mpi")
#: What to do about a collective that failed once every pair of hosts connected.
COLLECTIVE_FIX = ("every pair of hosts connects, so the backend fails on the hosts named: a wrong result points at "
                  "a broken library there (reinstall torch, or the MPI library, on it); an error or a timeout at the "
                  "backend's own transport (gloo: set SPMD_IFNAME to the interface the pairs used; mpi: the MPI "
                  "library's network settings); run the doctor with the other backend (SPMD_BACKEND=gloo or mpi) to "
                  "tell the backend from the hosts")


@dataclass(frozen=True)
class Finding:
    """One thing worth saying: "error" (a job would fail) or "warning", its words, the hosts it names."""

    level: str
    text: str
    hosts: tuple[str, ...] = field(default=())
    fix: str | None = None  # what to do, when the words do not say it

    def as_dict(self) -> dict[str, Any]:
        return dict(asdict(self), hosts=list(self.hosts))


def name_findings(hosts: Sequence[dict[str, Any]]) -> list[Finding]:
    """A host whose name resolves to loopback or not at all; an address that reaches only some hosts."""
    out = []
    for h in hosts if len(hosts) > 1 else ():  # on one host every rank reaches the others on loopback
        resolves = h.get("resolves_to") or []
        chosen = f"{h['address']} ({h['interface']})" if h.get("address") else "no address"
        if resolves and all(ip.startswith("127.") or ip == "::1" for ip in resolves):
            out.append(Finding("warning", (
                f"{h['host']} resolves its own name to {', '.join(resolves)} (loopback): spmd uses {chosen} instead, "
                f"but a tool that trusts the name (MASTER_ADDR=$(hostname), torchrun --master-addr, MPICH's "
                f"hostfile) points other hosts at loopback; map {h['host']} to {h['address'] or 'its address'} in "
                f"its /etc/hosts (Debian writes 127.0.1.1 there)"), (h["host"],)))
        elif not resolves:
            out.append(Finding("warning", (
                f"{h['host']} cannot resolve its own name: spmd uses {chosen}, but MASTER_ADDR=$(hostname) "
                f"fails there; add {h['host']} to its /etc/hosts or DNS"), (h["host"],)))
        if h.get("error"):
            out.append(Finding("error", f"{h['host']}: {h['error']}", (h["host"],)))
        elif h.get("reaches_all") is False:
            out.append(Finding("warning", (
                f"{h['host']}'s address {chosen} is not on a network every other host has an address on "
                f"({h.get('why', '')}); if the job fails to connect, set SPMD_IFNAME to the interface the hosts share"),
                (h["host"],)))
    return out


def pair_findings(pairs: Sequence[dict[str, Any]]) -> list[Finding]:
    """Each pair of hosts that could not connect, both ways said once, and the fix."""
    failed = {(p["a"], p["b"]): p for p in pairs if not p["ok"]}
    out, said = [], set()
    for (a, b), p in sorted(failed.items()):
        if (a, b) in said:
            continue
        back = failed.get((b, a))
        both = back is not None and back["error"] == p["error"]
        arrow = "<->" if both else "->"
        said |= {(a, b), (b, a)} if both else {(a, b)}
        where = f"to {b}'s {p.get('address')}:{p.get('port')} on {p.get('interface')}"
        if both:
            where += f", and back to {a}'s {back.get('address')}:{back.get('port')} on {back.get('interface')}"
        out.append(Finding("error", f"{a} {arrow} {b}: {p['error']} ({where})", (a, b), PAIR_FIX))
    return out


def version_findings(hosts: Sequence[dict[str, Any]], mpi: bool = True) -> list[Finding]:
    """Each version that differs between hosts (naming the fewest), or between the ranks of one host; mpi:
    an MPI launcher started the doctor, so mpi4py and the MPI library must agree too (else they warn)."""
    out = []
    keys = list(dict.fromkeys(k for h in hosts for k in h["versions"]))
    for key in keys:
        level = "error" if key in VERSIONS_THAT_BLOCK and (mpi or key not in MPI_VERSIONS) else "warning"
        for h in hosts:
            own = {v.get(key) for v in h.get("rank_versions", {}).values()}
            if len(own) > 1:
                out.append(Finding(level, f"the ranks on {h['host']} run different {key} versions "
                                          f"({', '.join(sorted(map(str, own)))}): one Python for every rank", (h["host"],)))
        seen = Counter(h["versions"].get(key) for h in hosts)
        if len(seen) < 2:
            continue
        usual = seen.most_common(1)[0][0] if seen.most_common(2)[0][1] > seen.most_common(2)[1][1] else None
        odd = [h for h in hosts if h["versions"].get(key) != usual]
        if usual is None:
            listed = "; ".join(f"{h['host']} {h['versions'].get(key) or 'none'}" for h in hosts)
            text = f"the hosts run different {key} versions: {listed}"
        else:
            listed = ", ".join(f"{h['host']} has {key} {h['versions'].get(key) or '(not installed)'}" for h in odd[:8])
            text = f"{listed}, the others {usual}"
        fix = "install the same on every host" + (" (a job cannot mix them)" if level == "error" else
                                                  " (a job on the mpi backend cannot mix them)"
                                                  if key in MPI_VERSIONS else "")
        out.append(Finding(level, f"{text}: {fix}", tuple(h["host"] for h in odd)))
    return out


def clock_findings(hosts: Sequence[dict[str, Any]], root: str) -> list[Finding]:
    """Each host whose clock is more than CLOCK_SKEW seconds from rank 0's host's."""
    out = []
    for h in hosts:
        offset = h.get("clock_offset_s")
        if offset is not None and abs(offset) > CLOCK_SKEW:
            way = "ahead of" if offset > 0 else "behind"
            out.append(Finding("warning", f"{h['host']}'s clock is {abs(offset):.1f} s {way} {root}'s (rank 0's): "
                                          "traces and logs of the job disagree by as much, and munge refuses "
                                          "credentials past 5 minutes; run an NTP client on every host",
                               (h["host"],)))
    return out


def link_findings(pairs: Sequence[dict[str, Any]]) -> list[Finding]:
    """Each host whose measured links run below SLOW_LINK of the others' median (three hosts or more)."""
    measured = [p for p in pairs if p.get("mbps")]
    names = sorted({p["a"] for p in measured} | {p["b"] for p in measured})
    out = []
    if len(names) < 3:
        return out
    for host in names:
        own = [p["mbps"] for p in measured if host in (p["a"], p["b"])]
        rest = [p["mbps"] for p in measured if host not in (p["a"], p["b"])]
        if own and rest and statistics.median(own) < SLOW_LINK * statistics.median(rest):
            out.append(Finding("warning", (
                f"{host}'s links are slow: {statistics.median(own):.1f} MB/s to and from it (median of "
                f"{len(own)}), against {statistics.median(rest):.1f} MB/s between the other hosts: a capped or "
                f"shared link, a slower NIC, or a busy host; every collective waits for it"), (host,),
                f"find what slows {host}: its NIC's speed and duplex (ethtool), a traffic shaper (tc qdisc show), "
                f"other jobs' traffic or a busy CPU on {host} (top); or leave {host} out of the job"))
    return out


def silent_findings(silent: Sequence[dict[str, Any]], root: str) -> list[Finding]:
    """Each rank (or host) that said nothing to rank 0 within its step: its host, when, and the fix."""
    out = []
    for s in silent:
        hosts = tuple(s.get("hosts", ()))
        where = " and ".join(hosts)
        fix = (f"check that {where} reaches {root} (rank 0's host) over TCP, any port (a firewall or a route "
               f"between them), and that the rank did not crash there: its own output says which; or leave "
               f"{where} out of the job" if hosts else
               f"check that the launcher started every rank and that each rank's host reaches {root} (rank 0's "
               "host) over TCP: the silent rank's own output says why")
        out.append(Finding("error", f"{s['who']} said nothing to rank 0 within {s['seconds']:g} s ({s['when']}): it "
                                    f"is gone, or its host cannot reach rank 0's ({root})", hosts, fix))
    return out


def collective_findings(collectives: Sequence[dict[str, Any]] | None,
                        hosts: Sequence[dict[str, Any]]) -> list[Finding]:
    """Each collective that failed, by the hosts (and ranks) where it did; init's failure on every host."""
    where = {r: h["host"] for h in hosts for r in h.get("ranks", ())}
    out = []
    for c in collectives or ():
        if c["ok"]:
            continue
        ranks = c.get("ranks") or []
        names = tuple(dict.fromkeys(where.get(r, f"rank {r}") for r in ranks))
        if ranks:
            listed = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            on = f"on {listed} (rank{'s' * (len(ranks) != 1)} {', '.join(map(str, ranks[:8]))})"
        else:
            names, on = tuple(h["host"] for h in hosts), "on every host"
        out.append(Finding("error", f"{c['name']} failed {on}: {c['error']}",
                           tuple(n for n in names if not n.startswith("rank ")), COLLECTIVE_FIX))
    return out


def findings(hosts: Sequence[dict[str, Any]], pairs: Sequence[dict[str, Any]], silent: Sequence[dict[str, Any]],
             collectives: Sequence[dict[str, Any]] | None, root: str, mpi: bool = True) -> list[Finding]:
    """Every finding, errors first; mpi: an MPI launcher started the job (see version_findings)."""
    out = silent_findings(silent, root) + name_findings(hosts) + pair_findings(pairs)
    out += version_findings(hosts, mpi) + clock_findings(hosts, root) + link_findings(pairs)
    out += collective_findings(collectives, hosts)
    return sorted(out, key=lambda f: f.level != "error")


def blocks(found: Sequence[Finding]) -> bool:
    """Whether any finding would stop a job."""
    return any(f.level == "error" for f in found)
