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
