"""The soak's pure parts (tests/tools/soak.py): the seeded draw, the pairs, the checks, the table, the diff."""

import collections

import pytest

from tests.tools import soak

pytestmark = pytest.mark.unit


def test_the_seeded_draw_covers_every_kind_and_launcher_and_repeats_itself():
    for n in (5, 7, 14):
        assert {j.kind for j in soak.draw(n, seed=n)} == set(soak.KINDS), n
    for n, seed in ((15, 1), (20, 7), (200, 1)):
        jobs = soak.draw(n, seed)
        counts = collections.Counter((j.kind, j.launcher) for j in jobs)
        assert len(jobs) == n and len(counts) == len(soak.KINDS) * len(soak.LAUNCHERS), (n, counts)
        assert max(counts.values()) - min(counts.values()) <= 1, counts  # as even as n allows
        assert [j.index for j in jobs] == list(range(1, n + 1))
    assert soak.draw(20, 7) == soak.draw(20, 7) and soak.draw(20, 7) != soak.draw(20, 8)


def test_about_a_quarter_of_the_jobs_run_in_concurrent_pairs_each_job_once():
    jobs = soak.draw(200, 1)
    slots = soak.schedule(jobs, 1)
    assert [j for slot in slots for j in slot] == jobs
    assert sum(len(slot) == 2 for slot in slots) == 25 and {len(slot) for slot in slots} == {1, 2}
    assert soak.schedule(jobs, 1) == slots


def result(kind, launcher="spmd-run/gloo", status=1, seconds=1.0, out=None, **kw):
    out = "READY rank 0\nREADY rank 1\n" if out is None else out
    r = soak.Result(soak.Job(1, kind, launcher), status=status, seconds=seconds, out=out, **kw)
    r.problems = soak.check(r.job, r, soak.BOUNDS[kind])
    return r


def test_each_kind_is_checked_against_its_promise():
    ready = "READY rank 0\nREADY rank 1\n"
    assert not result("success", status=0, out=ready + "DONE rank 0\nDONE rank 1\n").problems
    assert result("success", status=1, out=ready + "DONE rank 0\nDONE rank 1\n").problems == ["exit status 1, not 0"]
    traceback = f"{soak.TRACEBACK}:\n  ...\n{soak.RAISED}\n"
    assert not result("raise", out=ready + traceback).problems
    assert result("raise", out=ready + traceback * 2).problems == [
        f"{soak.RAISED!r} 2 times, not once", f"{soak.TRACEBACK!r} 2 times, not once"]
    assert result("sigkill", status=0).problems == ["exit status 0, not non-zero"]
    assert result("sigkill", seconds=31.0).problems == ["ended 31.0 s after both ranks were ready (bound 30 s)"]
    assert not result("hang", out=ready + "all_reduce (call #3) timed out after 3 s waiting").problems
    assert result("hang").problems == ["'timed out after 3 s' missing from its output"]
    assert not result("launcher-kill", status=-9, seconds=0.1).problems
    assert result("launcher-kill", status=0, out="READY rank 0\n").problems == [
        "not every rank printed READY", "the launcher exited with 0 before it was killed"]


def test_the_table_counts_by_kind_and_launcher_and_the_remaining_row():
    ok = result("success", status=0, seconds=0.7, out="READY rank 0\nREADY rank 1\nDONE rank 0\nDONE rank 1\n")
    late = result("hang", "mpirun/mpi", status=1, seconds=30.0, out="READY rank 0\nREADY rank 1\ntimed out after 3 s")
    late.paired = True
    late.left["shm"] = ["/dev/shm/mpich_shm_1_0"]
    killed = result("launcher-kill", "mpirun/gloo", status=-9, seconds=0.2)
    killed.left["processes"] = ["123: python -m spmd"]
    final = {c: [] for c in soak.CATEGORIES}
    final["ports"] = ["tcp 127.0.0.1:5000 (inode 1)"]
    final["mpirun files"] = ["/tmp/hydra_hwloc_xmlfile_a", "/tmp/hydra_hwloc_xmlfile_b"]
    text = soak.table([late, ok, killed, ok], final)
    rows = soak.read_table(text)
    assert [(r["kind"], r["launcher/backend"]) for r in rows] == [
        ("success", "spmd-run/gloo"), ("hang", "mpirun/mpi"), ("launcher-kill", "mpirun/gloo"),
        ("**all**", ""), ("**remaining at the end**", "")]
    success, hang, kill, every, remaining = rows
    assert (success["jobs"], success["statuses seen"], success["unexpected"], success["worst end (s)"],
            success["bound (s)"]) == ("2", "0 x2", "0", "0.7", "20")
    assert (hang["in pairs"], hang["unexpected"], hang["worst end (s)"], hang["shm"], hang["processes"]) == (
        "1", "1", "30.0", "1", "0")
    assert (kill["statuses seen"], kill["processes"]) == ("-9 x1", "1")
    assert (every["jobs"], every["statuses seen"], every["unexpected"]) == ("4", "0 x2, -9 x1, 1 x1", "1")
    assert [remaining[c] for c in soak.CATEGORIES] == ["0", "1", "0", "0", "0", "2"]
    assert soak.statuses([None, 75, 75]) == "75 x2, - x1"


def test_the_leftover_diff_and_the_proc_tables(tmp_path):
    h1, h2 = "/tmp/hydra_hwloc_xmlfile_1", "/tmp/hydra_hwloc_xmlfile_2"
    before = {"ports": {"tcp 0.0.0.0:22 (inode 7)": "7"}, "shm": {}, "sockets": {}, "temp files": {"/t/a": "/t/a"},
              "mpirun files": {h1: h1}}
    after = {"ports": {"tcp 0.0.0.0:22 (inode 7)": "7", "tcp 127.0.0.1:5000 (inode 9)": "9"},
             "shm": {"/dev/shm/x": "/dev/shm/x"}, "sockets": {}, "temp files": {"/t/a": "/t/a", "/t/b": "/t/b"},
             "mpirun files": {h1: h1, h2: h2}}
    new = {"ports": {"tcp 127.0.0.1:5000 (inode 9)": "9"}, "shm": {"/dev/shm/x": "/dev/shm/x"}, "sockets": {},
           "temp files": {"/t/b": "/t/b"}, "mpirun files": {h2: h2}}
    assert soak.diff(before, after) == new
    assert soak.diff(after, after) == {"ports": {}, "shm": {}, "sockets": {}, "temp files": {}, "mpirun files": {}}
    tcp = tmp_path / "tcp"
    tcp.write_text(
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0100007F:1388 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0\n"
        "   1: 0100007F:1388 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 4243 1 0\n")
    assert soak.listening([tcp]) == {"tcp 127.0.0.1:5000 (inode 4242)": "4242"}
    unix = tmp_path / "unix"
    unix.write_text("Num       RefCount Protocol Flags    Type St Inode Path\n"
                    "0000: 00000002 00000000 00010000 0005 01 31337 /run/spmd/k.sock\n"
                    "0000: 00000003 00000000 00000000 0001 03 13212\n")
    assert soak.unix_sockets(unix) == {"unix /run/spmd/k.sock (inode 31337)": "31337"}
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("")
    walked = soak.walk(tmp_path)
    assert walked[str(tmp_path / "d" / "f")] is False and str(tmp_path / "d") in walked
    # Held by no process: a segment no job named is unattributed, one a job named is left over.
    left, odd = soak.attribute({"ports": {}, "sockets": {}, "temp files": {"/t/b": "/t/b"}, "mpirun files": {h2: h2},
                                "shm": {"/dev/shm/soak-test-x": "/dev/shm/soak-test-x",
                                        "/dev/shm/soak-test-y": "/dev/shm/soak-test-y"}},
                               "spmd-soak-none", {"/dev/shm/soak-test-y"})
    assert left["shm"] == ["/dev/shm/soak-test-y"] and odd["shm"] == ["/dev/shm/soak-test-x"]
    assert left["temp files"] == ["/t/b"] and left["mpirun files"] == [h2]


def test_the_segments_a_job_named_even_where_hydra_ran_its_lines_together():
    out = ("SHM rank 1: /dev/shm/mpich_shm_1_0READY rank 1\nSHM rank 0: /dev/shm/mpich_shm_1_0 /dev/shm/b\n"
           "[0] SHM rank 0: -\n")
    assert soak.named_segments(out) == {"/dev/shm/mpich_shm_1_0", "/dev/shm/b"}
