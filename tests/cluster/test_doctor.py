"""spmd doctor across the private cluster's hosts: a healthy cluster passes, and each fault is named.

Under Hydra the ranks meet through its PMI key space (no MPI_Init, which waits for ever on a
partition); under torchrun through its store.  A time bound starts where the doctor's does: when the
ranks met (``met_at`` in its --json, rank 0's CLOCK_MONOTONIC, one clock for every namespace of the
lab), never at the launch (docs/testing.md, "Time bounds").
"""

import json
import re
import subprocess
import sys
import time

import pytest

from spmd.doctor.collectives import NAMES
from tests.cluster.lab import SUBNET
from tests.cluster.runs import MPIEXEC, PY, env, mpiexec
from tests.support import REPO, finish

pytestmark = pytest.mark.cluster

DOCTOR = [PY, "-m", "spmd.doctor"]


def doctor(lab, *args, hosts=None, n=3, ppn=1):
    started = time.monotonic()
    out = mpiexec(lab, ["-n", n, "-ppn", ppn, *DOCTOR, *args], hosts, timeout=150)
    return out, time.monotonic() - started


def json_of(out):
    text = out.stdout
    return json.loads(text[text.index("{\n"):text.rindex("\n}") + 2])


def since_met(got, ended):
    """Seconds from the ranks' meeting (the doctor's met_at) to ended (time.monotonic() after its exit)."""
    return ended - got["met_at"]


def assert_facts(got):
    """Every host's versions, one MPI library string for all, and a clock near rank 0's (one machine)."""
    for h in got["hosts"]:
        assert all(h["versions"][k] for k in ("python", "torch", "spmd", "mpi4py")), h["versions"]
        assert isinstance(h["clock_offset_s"], float) and abs(h["clock_offset_s"]) < 1, h
    libraries = {h["versions"]["mpi"] for h in got["hosts"]}
    assert len(libraries) == 1 and libraries.pop().startswith("MPICH Version: "), got["hosts"]


def test_a_healthy_cluster_passes_with_every_pair_measured_and_a_loopback_name_warned(lab):
    lab.names("h2", loopback=True)
    out, _ = doctor(lab, "--json", n=6, ppn=2)
    assert out.returncode == 0, out.stdout[-4000:]
    got = json_of(out)
    assert got["ok"] and [h["host"] for h in got["hosts"]] == ["h1", "h2", "h3"]
    assert [sorted(h["ranks"]) for h in got["hosts"]] == [[0, 1], [2, 3], [4, 5]]
    assert all(h["interface"] == "eth0" and h["address"].startswith(SUBNET) for h in got["hosts"]), got["hosts"]
    assert all({"eth0", "dock0"} <= {a["interface"] for a in h["interfaces"]} for h in got["hosts"])  # and the trap
    assert len(got["pairs"]) == 6 and all(p["ok"] and p["connect_ms"] > 0 and p["mbps"] > 0 for p in got["pairs"])
    assert all(c["ok"] for c in got["collectives"]) and tuple(c["name"] for c in got["collectives"]) == NAMES
    h2 = got["hosts"][1]
    assert h2["resolves_to"] == ["127.0.1.1"] and "h2 resolves its own name to 127.0.1.1" in h2["warnings"][0]
    assert [f["level"] for f in got["findings"]] == ["warning"]
    assert_facts(got)


def test_a_silent_partition_is_named_both_ways_within_the_bound(lab):
    lab.drop("h2", "h3")
    out, took = doctor(lab)
    text = out.stdout
    assert out.returncode == 1, text[-4000:]
    assert re.search(r"^error: h2 <-> h3: no answer within 2 s: a firewall that drops packets, or a partition "
                     r"\(to h3's 198\.18\.0\.13:\d+ on eth0, and back to h2's 198\.18\.0\.12:\d+ on eth0\)$", text,
                     re.M), text[-4000:]
    assert len(re.findall(r"^error:", text, re.M)) == 1 and "collectives: not run" in text and "h1 <->" not in text
    assert "FAILED: 1 error" in text
    # the matrix: a row per host, by name, its own column '-', the dropped pair FAILED both ways
    ok, failed = r"ok [\d.]+ ms \d+ MB/s", "FAILED: no answer within 2 s"
    for row in (f"h1 +- +{ok} +{ok}", f"h2 +{ok} +- +{failed}", f"h3 +{ok} +{failed} +-"):
        assert re.search(f"^{row}$", text, re.M), (row, text[-4000:])
    assert took < 45, f"took {took:.0f} s"  # 6-8 s here; the bound leaves room for a loaded machine


def test_a_host_cut_off_from_rank_0s_host_is_named_and_the_rest_still_measured(lab):
    lab.drop("h1", "h3")
    out, took = doctor(lab)
    text = out.stdout
    assert out.returncode != 0, text[-4000:]
    assert "error: rank 2 on h3 said nothing to rank 0 within" in text, text[-4000:]
    assert "h3: rank 2 could not reach rank 0's store at 198.18.0.11:" in text, text[-4000:]
    assert re.search(r"^h1 .*ok [\d.]+ ms", text, re.M)  # h1 <-> h2 still measured
    assert took < 60, f"took {took:.0f} s"


def test_a_host_capped_at_a_tenth_is_named_in_the_matrix(lab):
    for host in ("h1", "h2"):
        lab.cap(host, 1000)
    lab.cap("h3", 100)
    out, _ = doctor(lab, "--json", "--no-collectives")
    assert out.returncode == 0, out.stdout[-4000:]
    got = json_of(out)
    speed = {(p["a"], p["b"]): p["mbps"] for p in got["pairs"]}
    capped = [v for pair, v in speed.items() if "h3" in pair]
    assert max(capped) < 20, speed  # 100 Mbit/s is 12.5 MB/s
    # 1 Gbit/s is 125 MB/s, but a loaded machine's senders measured 33-58 MB/s in 0.2 s: the matrix need only
    # set them apart from h3's
    assert all(v > 2 * max(capped) for pair, v in speed.items() if "h3" not in pair), speed
    (slow,) = got["findings"]
    assert slow["level"] == "warning" and slow["hosts"] == ["h3"] and slow["text"].startswith("h3's links are slow")
    assert got["collectives"] is None and got["collectives_skipped"] == "--no-collectives"


def test_a_host_with_other_packages_is_named(lab, tmp_path):
    """h3 runs a second venv over the first, with another python-hostlist (one of spmd's requirements): a
    warning; another spmd: an error; and the MPICH wheel's library, which lives in the first venv's prefix,
    does not load there: an error, found before any rank calls MPI_Init.  Its spmd is the same code with an
    installation record (dist-info) of version 0.0.1 ahead of the first venv's, and its Python runs isolated
    (-I: the checkout's own record, in the cwd and PYTHONPATH, off its path): versions are read from the
    records, as on a host where another spmd was installed."""
    venv = tmp_path / "venv2"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    site = next((venv / "lib").glob("python*/site-packages"))
    main = next((REPO / ".venv" / "lib").glob("python*/site-packages"))
    (site / "main-venv.pth").write_text(f"import site; site.addsitedir({str(main)!r})\n")
    record = next(main.glob("spmd-*.dist-info"))
    (site / "spmd-0.0.1.dist-info").mkdir()
    (site / "spmd-0.0.1.dist-info" / "METADATA").write_text(
        re.sub(r"(?m)^Version: .*$", "Version: 0.0.1", (record / "METADATA").read_text()))
    got = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
                          "--target", site, "python-hostlist==1.23.0"], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    other = str(venv / "bin" / "python")
    args = ["-ppn", "1"]  # one rank on each host of the hostfile, in its order: h3's runs the second venv
    for python in (PY, PY, other):
        isolated = ["-I"] if python == other else []  # h3: neither the checkout (cwd, PYTHONPATH) nor its record
        args += [":"] * (len(args) > 2) + ["-n", "1", python, *isolated, "-m", "spmd.doctor"]
    cmd = lab.mpiexec_args(MPIEXEC, args)
    out = finish(lab.popen("login", cmd, env()), 150, "spmd doctor with a second venv on h3")
    assert out.returncode == 1, out.stdout[-4000:]
    assert "warning: h3 has python-hostlist 1.23.0, the others 2." in out.stdout, out.stdout[-4000:]
    assert re.search(r"^error: h3 has spmd 0\.0\.1, the others \d+\.\d+\.\d+: install the same on every host "
                     r"\(a job cannot mix them\)$", out.stdout, re.M), out.stdout[-4000:]
    assert re.search(r"^error: h3 has mpi none \(RuntimeError: cannot load MPI library\), the others MPICH Version: "
                     r"\d", out.stdout, re.M), out.stdout[-4000:]
    assert "collectives: not run" in out.stdout


def test_torchrun_with_an_agent_per_host_runs_the_doctor(lab):
    """torchrun never starts MPI: every host still reports its MPI library, the same string on each."""
    torchrun = str(REPO / ".venv" / "bin" / "torchrun")
    agents = [lab.popen(host, [torchrun, "--nnodes", "3", "--nproc-per-node", "1", "--node-rank", str(i),
                               "--master-addr", f"{SUBNET}.11", "--master-port", "29519", "-m", "spmd.doctor",
                               "--json"], env())
              for i, host in enumerate(["h1", "h2", "h3"])]
    outs = [finish(a, 180, f"torchrun's agent on h{i + 1}") for i, a in enumerate(agents)]
    assert [a.returncode for a in agents] == [0, 0, 0], "\n".join(o.stdout[-3000:] for o in outs)
    got = json_of(outs[0])
    assert got["ok"] and got["launcher"] == "torchrun" and [h["host"] for h in got["hosts"]] == ["h1", "h2", "h3"]
    assert {c["backend"] for c in got["collectives"]} == {"gloo"} and all(c["ok"] for c in got["collectives"])
    assert_facts(got)
    assert '"hosts"' not in outs[1].stdout + outs[2].stdout  # rank 0 alone reports


@pytest.fixture(scope="module")
def lab8():
    """Eight hosts of one rank each, for the module's 8-host cases (a lab of 8 costs seconds to build)."""
    from tests.cluster.lab import Lab, LabUnavailable

    try:
        lab = Lab.start(hosts=8, dummy=False)
    except LabUnavailable as exc:
        pytest.skip(f"no private cluster here: {exc}")
    yield lab
    lab.stop()


@pytest.mark.parametrize("pair, within", [(("h4", "h7"), 15), (("h1", "h5"), 20)],
                         ids=["between-two-hosts", "with-rank-0s-host"])
def test_eight_hosts_with_a_silent_partition_end_bounded(lab8, pair, within):
    """8 hosts x 1 rank, two dropping each other's packets: the pair named, the rest measured, within the
    bound from the ranks' meeting to the launcher's exit.  Between two hosts the doctor waits 2 s a
    connection and 3 s for the matrix: the issue's 15 s (8.4-9.5 s measured, docs/doctor.md).  With rank
    0's host it also waits STEP (8 s) for the silent rank's facts (that rank cannot reach rank 0's store):
    15 s and 5 for a loaded machine (12.9-13.8 s measured)."""
    lab8.reset()
    a, b = pair
    lab8.drop(a, b)
    out, _ = doctor(lab8, "--json", n=8)
    ended = time.monotonic()
    lab8.reset()
    got = json_of(out)
    assert out.returncode == 1, out.stdout[-4000:]
    errors = [f["text"] for f in got["findings"] if f["level"] == "error"]
    failed = sorted((p["a"], p["b"]) for p in got["pairs"] if not p["ok"])
    if a == "h1":  # rank 4 never reports: its host is named, and every other pair still measured
        assert len(errors) == 1 and errors[0].startswith("rank 4 on h5 said nothing to rank 0 within"), errors
        assert failed == [] and len(got["pairs"]) == 7 * 6
    else:
        assert len(errors) == 1 and errors[0].startswith("h4 <-> h7: no answer within 2 s"), errors
        assert failed == [("h4", "h7"), ("h7", "h4")] and len(got["pairs"]) == 8 * 7
    assert sum(bool(p["mbps"]) for p in got["pairs"]) == len(got["pairs"]) - len(failed)
    took = since_met(got, ended)
    assert took < within, f"took {took:.1f} s from the ranks' meeting (the checks {got['seconds']:.1f} s)"


def test_spmd_preflight_names_a_partition_where_mpi_init_would_wait_for_ever(lab):
    """mpi backend under mpiexec, h2 and h3 dropping each other's packets: MPICH's MPI_Init waits for its
    whole bound there; with SPMD_PREFLIGHT=1 init names both directions of the pair, said once."""
    lab.drop("h2", "h3")
    started = time.monotonic()
    out = mpiexec(lab, ["-n", 3, "-ppn", 1, PY, REPO / "jobs" / "collectives.py"], timeout=150,
                  SPMD_PREFLIGHT="1", SPMD_BACKEND="mpi", SPMD_TIMEOUT="120")
    took = time.monotonic() - started
    text = out.stdout
    assert out.returncode != 0 and text.count("### spmd: init failed on every rank") == 1, text[-4000:]
    assert re.search(r"h2 -> h3: 198\.18\.0\.13:\d+ \(eth0\): no answer within 5 s", text), text[-4000:]
    assert re.search(r"h3 -> h2: 198\.18\.0\.12:\d+ \(eth0\)", text) and "h1 ->" not in text, text[-4000:]
    assert "Reduced result" not in text and took < 60, f"took {took:.0f} s"


@pytest.mark.parametrize("drop", [False, True])
def test_open_mpi_across_hosts_meets_over_mpi(lab, openmpi, drop):
    """Open MPI's mpirun over 3 hosts (its rsh agent enters each): the doctor's ranks meet over MPI point
    to point, rank 0 with each other rank alone; a partition between h2 and h3 is named all the same."""
    mpirun, python = openmpi
    if drop:
        lab.drop("h2", "h3")
    hostfile = lab.dir / "openmpi-hosts-3"
    hostfile.write_text("h1 slots=1\nh2 slots=1\nh3 slots=1\n")
    cmd = [mpirun, "--mca", "plm_rsh_agent", lab.enter, "--hostfile", hostfile, "--map-by", "ppr:1:node",
           "-n", "3", python, "-m", "spmd.doctor", "--json"]
    out = finish(lab.popen("login", [str(c) for c in cmd], env(SPMD_IFNAME="eth0", OMPI_ALLOW_RUN_AS_ROOT=1,
                                                                  OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)),
                 180, "spmd doctor under Open MPI across the lab's hosts")
    got = json_of(out)
    assert got["launcher"] == "openmpi" and [h["host"] for h in got["hosts"]] == ["h1", "h2", "h3"], got
    failed = sorted((p["a"], p["b"]) for p in got["pairs"] if not p["ok"])
    if drop:
        assert out.returncode != 0 and failed == [("h2", "h3"), ("h3", "h2")], out.stdout[-3000:]
    else:
        assert out.returncode == 0 and failed == [], out.stdout[-3000:]
        assert {c["backend"] for c in got["collectives"]} == {"mpi"} and all(c["ok"] for c in got["collectives"])
