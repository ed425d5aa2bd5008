"""The doctor's report: the JSON keys docs/doctor.md promises, and the text's table, matrix and findings."""

import json

import pytest

from spmd.doctor.judge import findings
from spmd.doctor.report import Report, as_json, as_text
from tests.doctor.test_judge import host, mesh, pair

pytestmark = pytest.mark.unit


def report(pairs=None, collectives=None):
    hosts = [host("h1", ranks=[0, 1]), host("h2", ranks=[2, 3], resolves_to=["127.0.1.1"])]
    pairs = pairs if pairs is not None else mesh(["h1", "h2"])
    return Report("mpich", 4, hosts, pairs, findings(hosts, pairs, [], collectives, "h1"), collectives,
                  None if collectives else "--no-collectives")


def test_json_has_the_promised_keys():
    got = json.loads(as_json(report()))
    assert got["ok"] is True and got["ranks"] == 4
    assert set(got["hosts"][0]) >= {"host", "address", "interface", "resolves_to", "versions", "clock_offset_s",
                                    "warnings"}
    assert set(got["pairs"][0]) >= {"a", "b", "ok", "error", "connect_ms", "mbps"}
    assert got["hosts"][1]["warnings"] and "127.0.1.1" in got["hosts"][1]["warnings"][0]
    assert got["hosts"][0]["warnings"] == []


def test_text_shows_the_hosts_the_matrix_and_the_verdict():
    drop = "no answer within 2 s: a firewall that drops packets, or a partition"
    text = as_text(report([pair("h1", "h2"), pair("h2", "h1", False, drop)]))
    assert "spmd doctor: 2 hosts, 4 ranks, started by mpich" in text
    assert "FAILED: no answer within 2 s" in text and "ok 0.2 ms 1000 MB/s" in text
    assert "error: h2 -> h1: no answer" in text and "  fix: " in text and "warning: h2 resolves" in text
    assert text.splitlines()[-1] == "FAILED: 1 error: a job would fail here"


def test_text_lists_the_collectives_when_they_ran():
    ran = [{"name": "barrier", "ok": True, "ms": 0.5, "error": None, "backend": "gloo"}]
    text = as_text(report(collectives=ran))
    assert "on backend gloo): barrier 0.5 ms" in text and text.splitlines()[-1].startswith("ok: ")


def test_the_time_from_the_ranks_meeting_and_a_warnings_fix_are_said():
    names = ["h1", "h2", "h3"]
    hosts = [host(n, ranks=[i]) for i, n in enumerate(names)]
    pairs = [pair(a, b, mbps=8.0 if "h3" in (a, b) else 900.0) for a in names for b in names if a != b]
    done = Report("mpich", 3, hosts, pairs, findings(hosts, pairs, [], None, "h1"), met_at=1234.5, seconds=4.25)
    text = as_text(done)
    assert text.splitlines()[0] == "spmd doctor: 3 hosts, 3 ranks, started by mpich; checked in 4.2 s from the " \
                                   "ranks' meeting"
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("warning: h3's links are slow"))
    assert lines[at + 1].startswith("  fix: find what slows h3")
    got = json.loads(as_json(done))
    assert (got["met_at"], got["seconds"]) == (1234.5, 4.25)
