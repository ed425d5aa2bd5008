"""The doctor's steps on every rank, rank 0 leading: facts, listeners, every pair, the matrix, collectives.

The ranks meet through a :class:`spmd.runtime.star.Star` (``open_star``: Hydra's key space before
MPI starts, a rendezvous store, or MPI point to point), which never routes between two other hosts;
every step is bounded: a rank that stays silent is named, never waited for.  The first rank of each
host leads it: it listens on the address spmd would use there (``spmd.doctor.links``), connects to
every other host's, reads its clock against rank 0's host, and sends bytes to one host at a time in
the rounds of the matrix.  Only when nothing found would stop a job does it start spmd itself and
run one of every collective.  Rank 0 judges (``spmd.doctor.judge``) and reports.  docs/doctor.md.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping

from spmd.config.placement import detect
from spmd.doctor import judge
from spmd.doctor.collectives import combine, run_each
from spmd.doctor.facts import card_of, local_facts
from spmd.doctor.links import LinkServer, clock_offset, pairings, send_for
from spmd.doctor.report import Report
from spmd.errors import RendezvousError
from spmd.runtime import network
from spmd.runtime.pairs import connect_time
from spmd.runtime.star import Star, StarSilence, open_star
from spmd.runtime.start import finalize

__all__ = ["Options", "Outcome", "diagnose", "STEP"]

#: Seconds a step after the first may take on a rank before rank 0 names it silent.
STEP = 8.0
#: Seconds the whole bandwidth matrix may take: with many hosts, each round sends for less.
MATRIX_WITHIN = 3.0


@dataclass(frozen=True)
class Options:
    """How long the ranks wait to meet, how long a connection may take, what the matrix sends."""

    timeout: float = 20.0
    connect_within: float = 2.0
    bandwidth_seconds: float = 0.2
    bandwidth_bytes: int = 64 * 2**20
    collectives: bool = True


@dataclass
class Outcome:
    """What this rank ends with: its exit status, rank 0's report, or this rank's own words."""

    status: int
    report: Report | None = None
    note: str | None = None
    abandoned: bool = False  # a peer went silent: MPI may not end cleanly, so end without it


def diagnose(environ: Mapping[str, str], options: Options) -> Outcome:
    """Run every step on this rank; rank 0's outcome holds the report."""
    placement = detect(environ)
    star = open_star(placement, environ, options.timeout, "spmd/doctor")
    try:
        return _Walk(star, environ, options, placement.is_mpi).run()
    except StarSilence as exc:
        return Outcome(1, note=f"spmd doctor: {socket.gethostname()}: {exc}", abandoned=True)
    finally:
        star.close()


class _Walk:
    """One rank's way through the steps (rank 0 also gathers, plans and judges)."""

    def __init__(self, star: Star, environ: Mapping[str, str], options: Options, mpi: bool = False) -> None:
        self.star, self.environ, self.o, self.mpi = star, environ, options, mpi
        self.root = star.rank == 0
        self.silent: list[dict[str, Any]] = []  # rank 0's: who said nothing, and when
        self.probed: dict[int, Any] = {}  # rank 0's: each host's connections to the others, and its clock
        self.met_at: float | None = None  # rank 0's: when the ranks met (time.monotonic), where the bound starts

    def run(self) -> Outcome:
        star, o = self.star, self.o
        # The bound starts where the ranks have met: under Hydra at its barrier (every rank has started, so
        # rank 0's wait for a silent one is inside it), elsewhere once rank 0 has every rank's facts.
        self.met_at = time.monotonic() if star.met else None
        facts = local_facts(star.rank)
        first = STEP if star.met else o.timeout  # the launcher's barrier already waited for every start
        everyone = star.collect(facts, first)
        self.met_at = self.met_at or time.monotonic()
        plan = star.share(self._plan(everyone, first) if self.root else None, first + STEP)
        mine = [i for i, h in enumerate(plan["hosts"]) if star.rank in h["ranks"]]
        if not mine:
            return Outcome(1, note=f"spmd doctor: rank {star.rank}: rank 0 did not hear this rank within "
                                   f"{first:g} s of the start", abandoned=True)
        me, secret = mine[0], plan["secret"].encode()
        leader = plan["hosts"][me]["leader"] == star.rank
        server, listen = self._listen(facts, plan, secret) if leader else (None, None)
        try:
            listens = star.collect(listen, STEP)
            table = star.share(self._table(plan, listens) if self.root else None, 2 * STEP)
            probed = self._probe(table, me, secret) if leader else None
            results = star.collect(probed, STEP + 2 * o.connect_within)
            rounds = star.share(self._rounds(table, results) if self.root else None, 3 * STEP)
            speeds = self._matrix(rounds, table, me, secret, leader)
        finally:
            if server is not None:
                server.close()
        report = self._report(plan, table, results, speeds) if self.root else None
        verdict = star.share(None if report is None else {"ok": report.ok}, 2 * STEP)
        star.collect(None, STEP)  # every rank is done with the star: rank 0 may close its store
        star.close()
        if verdict["ok"] and o.collectives:
            return self._collectives(report)
        if report is not None:
            report.skipped = "the errors below would stop a job first" if not report.ok else "--no-collectives"
        return Outcome(0 if verdict["ok"] else 1, report, abandoned=bool(self.silent))

    # -- rank 0's parts ---------------------------------------------------------------------------

    def _plan(self, everyone: list[Any], seconds: float) -> dict[str, Any]:
        """The hosts (by where each rank really runs), the ranks that said nothing, and the links' secret."""
        hosts: dict[str, dict[str, Any]] = {}
        for rank, facts in enumerate(everyone):
            if facts is None:
                card = self.star.cards[rank] if self.star.cards else None
                self.silent.append({"who": f"rank {rank}" + (f" on {card.name}" if card else ""), "seconds": seconds,
                                    "when": "at the start", "hosts": [card.name] if card else []})
                continue
            key = facts["card"]["key"]
            host = hosts.setdefault(key, {"host": facts["card"]["name"], "key": key, "ranks": [], "leader": rank,
                                          "card": facts["card"], "versions": facts["versions"], "rank_versions": {}})
            host["ranks"].append(rank)
            host["rank_versions"][str(rank)] = facts["versions"]
        return {"hosts": list(hosts.values()), "secret": secrets.token_hex(16)}

    def _table(self, plan: dict[str, Any], listens: list[Any]) -> list[dict[str, Any]]:
        """Each host's listener (address, port, interface, why), or why it has none."""
        table = []
        for h in plan["hosts"]:
            got = listens[h["leader"]]
            if got is None:
                self._lost(h, "while the hosts opened their listeners")
                got = {"error": "said nothing"}
            table.append(dict(got, host=h["host"], ranks=h["ranks"], leader=h["leader"]))
        return table

    def _rounds(self, table: list[dict[str, Any]], results: list[Any]) -> list[list[list[Any]]]:
        """The matrix's rounds: pairs of hosts with a connection at least one way, and which ways."""
        for i, h in enumerate(table):
            got = results[h["leader"]] if h.get("port") else None
            if h.get("port") and got is None:
                self._lost(h, "while the hosts connected to each other")
            self.probed[i] = got
        ok = {(i, p["b"]) for i, got in self.probed.items() if got for p in got["pairs"] if p["ok"]}
        live = [i for i, got in self.probed.items() if got is not None]
        return [[[a, b, (a, b) in ok, (b, a) in ok] for a, b in r if (a, b) in ok or (b, a) in ok]
                for r in pairings(live)]

    def _lost(self, host: dict[str, Any], when: str) -> None:
        ranks = ", ".join(map(str, host["ranks"][:8]))
        self.silent.append({"who": f"{host['host']} (rank {ranks})", "seconds": STEP, "when": when,
                            "hosts": [host["host"]]})

    def _report(self, plan, table, results, speeds) -> Report:
        hosts, pairs = [], []
        for i, (h, t) in enumerate(zip(plan["hosts"], table)):
            got = self.probed.get(i) or {}
            hosts.append({"host": h["host"], "ranks": h["ranks"], "address": t.get("address"),
                          "interface": t.get("interface"), "why": t.get("why"), "reaches_all": t.get("reaches_all"),
                          "resolves_to": list(h["card"]["resolves_to"]), "versions": h["versions"],
                          "interfaces": [{k: a[k] for k in ("interface", "ip", "prefix", "up")}
                                         for a in h["card"]["addresses"]],
                          "rank_versions": h["rank_versions"], "error": t.get("error") if t.get("port") is None
                          and t.get("error") != "said nothing" else None,
                          "clock_offset_s": 0.0 if i == 0 else got.get("clock")})
            for p in got.get("pairs", ()):
                b = table[p["b"]]
                pairs.append({"a": h["host"], "b": b["host"], "ok": p["ok"], "error": p["error"],
                              "connect_ms": p["connect_ms"], "mbps": speeds.get(f"{i}>{p['b']}"),
                              "address": b.get("address"), "port": b.get("port"), "interface": b.get("interface")})
        found = judge.findings(hosts, pairs, self.silent, None, hosts[0]["host"] if hosts else "rank 0", self.mpi)
        launcher = detect(self.environ).launcher
        return Report(launcher, self.star.size, hosts, pairs, found, met_at=self.met_at,
                      seconds=time.monotonic() - self.met_at)

    # -- a host's leader's parts ------------------------------------------------------------------

    def _listen(self, facts, plan, secret) -> tuple[LinkServer | None, dict[str, Any]]:
        """Listen where spmd would serve from this host; return the server and what to tell rank 0."""
        card = card_of(facts)
        cards = [card_of(h) for h in plan["hosts"]]
        try:
            choice = network.choose_server(card, cards, self.environ)
        except RendezvousError as exc:
            return None, {"error": str(exc)}
        said = {"address": choice.address, "interface": choice.interface, "why": choice.why,
                "reaches_all": choice.reaches_all}
        try:
            server = LinkServer(choice.address, secret)
        except OSError as exc:
            return None, dict(said, error=f"cannot listen on {choice.address} ({choice.interface}): {exc}")
        return server, dict(said, port=server.port, error=None)

    def _probe(self, table, me, secret) -> dict[str, Any]:
        """Connect to every other host's listener at once; read this host's clock against host 0's."""
        found: list[dict[str, Any]] = []

        def one(j: int, t: dict[str, Any]) -> None:
            ms, why = connect_time(t["address"], t["port"], self.o.connect_within)
            found.append({"b": j, "ok": why is None, "error": why, "connect_ms": ms})

        threads = [threading.Thread(target=one, args=(j, t), daemon=True)
                   for j, t in enumerate(table) if j != me and t.get("port")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.o.connect_within + 1)
        clock = None
        if me != 0 and table[0].get("port") and any(p["b"] == 0 and p["ok"] for p in found):
            clock = clock_offset(table[0]["address"], table[0]["port"], secret)
        return {"pairs": sorted(found, key=lambda p: p["b"]), "clock": clock}

    def _matrix(self, rounds, table, me, secret, leader) -> dict[str, float]:
        """Every round: send to this host's partner (both ways at once); rank 0 keeps 'a>b': MB/s."""
        speeds: dict[str, float] = {}
        seconds = min(self.o.bandwidth_seconds, MATRIX_WITHIN / max(1, len(rounds)))
        for pairs in rounds if seconds > 0 else ():
            sent = None
            for a, b, a_to_b, b_to_a in pairs if leader else ():
                if (me, a_to_b) == (a, True) or (me, b_to_a) == (b, True):
                    to = b if me == a else a
                    mbps, why = send_for(table[to]["address"], table[to]["port"], secret, seconds,
                                         self.o.bandwidth_bytes)
                    sent = {"key": f"{me}>{to}", "mbps": mbps, "error": why}
            got = self.star.collect(sent, STEP + seconds)
            for s in got or ():
                if s and s["mbps"]:
                    speeds[s["key"]] = s["mbps"]
            self.star.share(None, 2 * STEP + seconds)  # the next round starts together
        return speeds

    # -- every rank -------------------------------------------------------------------------------

    def _collectives(self, report: Report | None) -> Outcome:
        comm, per_rank = run_each(self.o.timeout)
        if comm is None:  # init failed on every rank alike
            return Outcome(1, None if report is None else self._judged(report, per_rank))
        status = None
        if report is not None:
            report = self._judged(report, combine(per_rank))
            status = 0 if report.ok else 1
        status = comm.broadcast_object(status, 0)
        finalize()
        return Outcome(status, report)

    def _judged(self, report: Report, collectives: list[dict[str, Any]]) -> Report:
        """report judged again with the collectives' results."""
        found = judge.findings(report.hosts, report.pairs, self.silent, collectives, report.hosts[0]["host"], self.mpi)
        return Report(report.launcher, report.size, report.hosts, report.pairs, found, collectives,
                      met_at=report.met_at, seconds=time.monotonic() - report.met_at)
