"""The doctor's judge: each finding from made-up measurements, its level, its hosts and its words."""

import pytest

from spmd.doctor.judge import blocks, clock_findings, collective_findings, findings, link_findings, name_findings, \
    pair_findings, silent_findings, version_findings

pytestmark = pytest.mark.unit

VERSIONS = {"python": "3.11.7", "torch": "2.13.0", "spmd": "0.1.0", "mpi4py": "4.1.2", "python-hostlist": "2.3.0"}


def host(name, **extra):
    out = {"host": name, "address": f"198.18.0.{10 + int(name[1:])}", "interface": "eth0", "reaches_all": True,
           "resolves_to": [f"198.18.0.{10 + int(name[1:])}"], "versions": dict(VERSIONS), "rank_versions": {},
           "clock_offset_s": 0.0, "error": None}
    out.update(extra)
    return out


def pair(a, b, ok=True, error=None, mbps=1000.0):
    return {"a": a, "b": b, "ok": ok, "error": error, "connect_ms": 0.2 if ok else None, "mbps": mbps if ok else None,
            "address": f"198.18.0.{10 + int(b[1:])}", "port": 4000 + int(b[1:]), "interface": "eth0"}


def mesh(names, **overrides):
    return [overrides.get((a, b), pair(a, b)) for a in names for b in names if a != b]


def test_a_healthy_cluster_has_nothing_to_say():
    hosts = [host("h1"), host("h2"), host("h3")]
    assert findings(hosts, mesh(["h1", "h2", "h3"]), [], [], "h1") == []


def test_a_silent_partition_is_one_error_naming_both_hosts_both_ways():
    drop = "no answer within 2 s: a firewall that drops packets, or a partition"
    pairs = mesh(["h1", "h2", "h3"])
    pairs = [pair(p["a"], p["b"], False, drop) if {p["a"], p["b"]} == {"h2", "h3"} else p for p in pairs]
    found = pair_findings(pairs)
    assert len(found) == 1 and found[0].level == "error" and found[0].hosts == ("h2", "h3")
    assert found[0].text.startswith("h2 <-> h3: no answer within 2 s") and "198.18.0.13:4003" in found[0].text
    assert "198.18.0.12:4002" in found[0].text and "SPMD_IFNAME" in found[0].fix


def test_a_refusal_one_way_is_said_that_way():
    refused = "refused after 0.0 s: a firewall that rejects the port"
    pairs = [pair("h1", "h2"), pair("h2", "h1", False, refused)]
    found = pair_findings(pairs)
    assert [f.text.split(":")[0] for f in found] == ["h2 -> h1"]


def test_a_loopback_name_is_a_warning_with_the_fix():
    found = name_findings([host("h1", resolves_to=["127.0.1.1"]), host("h2")])
    assert [f.level for f in found] == ["warning"] and found[0].hosts == ("h1",)
    assert "h1 resolves its own name to 127.0.1.1 (loopback)" in found[0].text and "/etc/hosts" in found[0].text
    assert name_findings([host("h1", resolves_to=["127.0.1.1"])]) == []  # one host: loopback is right


def test_a_name_that_does_not_resolve_and_a_host_that_cannot_listen():
    found = name_findings([host("h1", resolves_to=[]), host("h2", error="cannot listen on 198.18.0.12: busy")])
    assert [(f.level, f.hosts) for f in found] == [("warning", ("h1",)), ("error", ("h2",))]
    assert "h1 cannot resolve its own name" in found[0].text


def test_versions_name_the_odd_host_and_block_only_where_a_job_cannot_mix():
    hosts = [host("h1"), host("h2"), host("h3")]
    hosts[2]["versions"] = dict(VERSIONS, torch="2.12.0", **{"python-hostlist": "1.23.0"})
    found = version_findings(hosts)
    by = {f.text.split(",")[0]: f for f in found}
    assert by["h3 has torch 2.12.0"].level == "error" and "the others 2.13.0" in by["h3 has torch 2.12.0"].text
    assert by["h3 has python-hostlist 1.23.0"].level == "warning"
    assert all(f.hosts == ("h3",) for f in found)


def test_versions_of_two_hosts_that_disagree_list_both():
    hosts = [host("h1"), host("h2", versions=dict(VERSIONS, spmd="0.2.0"))]
    (found,) = version_findings(hosts)
    assert "h1 0.1.0" in found.text and "h2 0.2.0" in found.text and found.level == "error"


def test_ranks_of_one_host_on_different_pythons():
    h = host("h1", rank_versions={"0": VERSIONS, "1": dict(VERSIONS, python="3.10.0")})
    (found,) = version_findings([h])
    assert "the ranks on h1 run different python versions" in found.text


def test_a_skewed_clock_names_the_host_and_the_direction():
    found = clock_findings([host("h1"), host("h2", clock_offset_s=3.24), host("h3", clock_offset_s=-0.1)], "h1")
    assert [f.text.split(":")[0] for f in found] == ["h2's clock is 3.2 s ahead of h1's (rank 0's)"]


def test_a_capped_host_is_named_slow_and_two_hosts_have_no_reference():
    names = ["h1", "h2", "h3", "h4"]
    pairs = [pair(a, b, mbps=8.0 if "h3" in (a, b) else 900.0) for a in names for b in names if a != b]
    (found,) = link_findings(pairs)
    assert found.hosts == ("h3",) and found.text.startswith("h3's links are slow: 8.0 MB/s")
    assert found.fix.startswith("find what slows h3: its NIC's speed and duplex (ethtool), a traffic shaper")
    assert found.fix.endswith("or leave h3 out of the job")
    assert link_findings([pair("h1", "h2", mbps=1.0), pair("h2", "h1", mbps=900.0)]) == []


def test_errors_come_first_and_block():
    hosts = [host("h1", resolves_to=["127.0.1.1"]), host("h2")]
    silent = [{"who": "rank 3 on h2", "seconds": 8, "when": "at the start", "hosts": ["h2"]}]
    found = findings(hosts, mesh(["h1", "h2"]), silent,
                     [{"name": "all_reduce", "ok": False, "error": "x", "ranks": [1]}], "h1")
    assert [f.level for f in found] == ["error", "error", "warning"] and blocks(found)
    assert found[0].text.startswith("rank 3 on h2 said nothing to rank 0 within 8 s") and found[0].hosts == ("h2",)
    assert not blocks([f for f in found if f.level == "warning"])


def test_a_silent_rank_names_its_host_and_the_fix():
    silent = [{"who": "rank 2 on h3", "seconds": 8, "when": "at the start", "hosts": ["h3"]}]
    (found,) = silent_findings(silent, "h1")
    assert found.level == "error" and found.hosts == ("h3",)
    assert found.text == ("rank 2 on h3 said nothing to rank 0 within 8 s (at the start): it is gone, or its host "
                          "cannot reach rank 0's (h1)")
    assert found.fix.startswith("check that h3 reaches h1 (rank 0's host) over TCP, any port (a firewall or a route")
    assert "its own output says which; or leave h3 out of the job" in found.fix
    (unknown,) = silent_findings([{"who": "rank 5", "seconds": 20, "when": "at the start"}], "h1")
    assert unknown.hosts == () and "the launcher started every rank" in unknown.fix


def test_a_failed_collective_names_its_hosts_and_ranks_and_the_fix():
    hosts = [host("h1", ranks=[0, 1]), host("h2", ranks=[2, 3]), host("h3", ranks=[4, 5])]
    failed = {"name": "all_reduce", "ok": False, "error": "a wrong result", "ranks": [2, 3, 5], "ms": 1.0}
    (found,) = collective_findings([failed, dict(failed, name="barrier", ok=True, ranks=[])], hosts)
    assert found.level == "error" and found.hosts == ("h2", "h3")
    assert found.text == "all_reduce failed on h2, h3 (ranks 2, 3, 5): a wrong result"
    assert found.fix.startswith("every pair of hosts connects, so the backend fails on the hosts named")
    assert "SPMD_BACKEND=gloo or mpi" in found.fix and "SPMD_IFNAME" in found.fix
    (init,) = collective_findings([{"name": "init", "ok": False, "error": "timed out", "ms": None}], hosts)
    assert init.text == "init failed on every host: timed out" and init.hosts == ("h1", "h2", "h3")


def test_an_mpi_library_that_does_not_load_is_an_error_under_mpi_and_a_warning_elsewhere():
    hosts = [host("h1"), host("h2"), host("h3", versions=dict(VERSIONS, mpi="none (RuntimeError: cannot load)"))]
    for h in hosts[:2]:
        h["versions"]["mpi"] = "MPICH Version: 5.0.2"
    (under_mpi,) = version_findings(hosts)
    assert under_mpi.level == "error" and under_mpi.hosts == ("h3",)
    assert under_mpi.text.startswith("h3 has mpi none (RuntimeError: cannot load), the others MPICH Version: 5.0.2")
    (elsewhere,) = version_findings(hosts, mpi=False)
    assert elsewhere.level == "warning" and elsewhere.text.endswith("(a job on the mpi backend cannot mix them)")
    hosts[2]["versions"]["torch"] = "2.12.0"
    assert {f.level for f in version_findings(hosts, mpi=False) if "torch" in f.text} == {"error"}
