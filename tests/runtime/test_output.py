"""Whole lines on stdout and stderr (spmd.runtime.output): the streams in process, then real launchers.

Unit tests put spmd.runtime.output's streams over a pipe of their own and read back
what the kernel was handed, write by write.  Launcher tests make two ranks
print thousands of lines fast with PYTHONUNBUFFERED=1, where print writes
text and newline apart, and check that every line arrives whole.
"""

import collections
import io
import os
import re
import sys
import textwrap

import pytest

from tests.support import MPIRUN, PY, clean_env, run, tool
from spmd.failfast import abort
from spmd.runtime import output
from spmd.launch.supervise import child_env


# -- in process: a whole-line stream over a pipe, and every os.write it makes --


class Pipe:
    """A pipe whose write end carries a stream like sys.stdout; records each os.write to it."""

    def __init__(self, monkeypatch, unbuffered=True):
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        self.writes = []
        real = os.write

        def spy(fd, data):
            if fd == self.w:
                self.writes.append(bytes(data))
            return real(fd, data)

        class Recording(io.FileIO):  # plain Python's own writes, not through os.write
            def write(self, data):
                writes.append(bytes(data))
                return super().write(data)

        writes = self.writes
        monkeypatch.setattr(os, "write", spy)
        raw = Recording(self.w, "wb", closefd=False)
        self.plain = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw),
                                      encoding="utf-8", newline="\n", write_through=unbuffered)
        self.plain.mode = "w"  # as Python's own sys.stdout

    def read(self):
        chunks = []
        while True:
            try:
                chunk = os.read(self.r, 1 << 16)
            except BlockingIOError:
                break
            chunks.append(chunk)
        return b"".join(chunks).decode()

    def close(self):
        os.close(self.r)
        os.close(self.w)


@pytest.fixture
def pipe(monkeypatch):
    p = Pipe(monkeypatch)
    yield p
    p.close()


def whole(pipe, tag=""):
    return output._replace(pipe.plain, tag)


@pytest.mark.unit
def test_plain_unbuffered_print_writes_text_and_newline_apart(pipe):
    print("OK", 0, file=pipe.plain)
    assert pipe.writes == [b"OK", b" ", b"0", b"\n"]  # what lets another rank's line in between


@pytest.mark.unit
def test_each_print_is_one_write_of_its_whole_line(pipe):
    out = whole(pipe)
    print("OK", 0, 4, "mpi", file=out)
    print("next", file=out)
    assert pipe.writes == [b"OK 0 4 mpi\n", b"next\n"]
    assert pipe.read() == "OK 0 4 mpi\nnext\n"


@pytest.mark.unit
def test_a_partial_line_waits_for_its_newline_or_a_flush(pipe):
    out = whole(pipe)
    print("50%", end="", file=out)
    out.write(" done")
    assert pipe.writes == []
    print(file=out)
    assert pipe.writes == [b"50% done\n"]
    print("p", end="", file=out, flush=True)
    assert pipe.writes[-1] == b"p"
    out.write("a\nb")  # the whole line now, the rest with its newline
    assert pipe.writes[-1] == b"a\n"
    out.write("c\n")
    assert pipe.read() == "50% done\npa\nbc\n"


@pytest.mark.unit
def test_many_lines_go_out_in_whole_lines_of_at_most_pipe_buf(pipe):
    out = whole(pipe)
    lines = [f"{i:05d} " + "y" * 94 for i in range(300)]
    out.write("\n".join(lines) + "\n")
    assert len(pipe.writes) == 8
    assert all(len(w) <= output.PIPE_BUF and w.endswith(b"\n") for w in pipe.writes)
    assert pipe.read().splitlines() == lines


@pytest.mark.unit
def test_a_line_longer_than_pipe_buf_is_one_write(pipe):
    out = whole(pipe)
    out.write("a\n" + "z" * 5000 + "\nb\n")
    assert pipe.writes == [b"a\n", b"z" * 5000 + b"\n", b"b\n"]


@pytest.mark.unit
def test_block_buffered_stays_block_buffered_and_cuts_at_newlines(monkeypatch):
    p = Pipe(monkeypatch, unbuffered=False)
    try:
        out = output._replace(p.plain, "")
        assert not out.line_buffering
        for i in range(2000):
            print("line", i, file=out)
        print("tail", end="", file=out)
        assert 2 < len(p.writes) < 20  # blocks, not a write per line
        assert all(w.endswith(b"\n") and len(w) <= output.PIPE_BUF for w in p.writes)
        out.flush()
        assert p.writes[-1].endswith(b"tail")
        assert p.read() == "".join(f"line {i}\n" for i in range(2000)) + "tail"
    finally:
        p.close()


@pytest.mark.unit
def test_tagged_lines_carry_the_rank_once_each(pipe):
    out = whole(pipe, output.prefix(3, 12))
    print("one", file=out)
    out.write("two\nthr")
    out.flush()
    out.write("ee\nfour\n")
    assert pipe.read() == "[ 3] one\n[ 3] two\n[ 3] three\n[ 3] four\n"
    assert output.prefix(0, 2) == "[0] " and output.prefix(10, 11) == "[10] "


@pytest.mark.unit
def test_input_shows_its_prompt(pipe, monkeypatch):
    monkeypatch.setattr(sys, "stdout", whole(pipe))
    monkeypatch.setattr(sys, "stdin", io.StringIO("yes\n"))
    assert input("continue? ") == "yes"
    assert pipe.read() == "continue? "


@pytest.mark.unit
def test_an_abort_writes_the_partial_line(pipe, monkeypatch):
    class Exited(Exception):
        pass

    def fake_exit(code):
        raise Exited(code)

    monkeypatch.setattr(sys, "stdout", whole(pipe))
    monkeypatch.setattr(os, "_exit", fake_exit)
    print("last words", end="")
    with pytest.raises(Exited):
        abort.exit_now(1)
    assert pipe.read() == "last words"


@pytest.mark.unit
def test_a_print_inside_a_write_neither_deadlocks_nor_loses_text(pipe, monkeypatch):
    out = whole(pipe)
    real, inner = os.write, []

    def interrupted(fd, data):  # as a signal handler that prints would, mid-write
        if not inner:
            inner.append(1)
            out.write("handler\n")
        return real(fd, data)

    out.write("begun ")
    monkeypatch.setattr(os, "write", interrupted)
    out.write("ended\n")
    assert sorted(pipe.read().splitlines()) == ["begun ended", "handler"]


@pytest.mark.unit
def test_install_replaces_only_the_process_own_streams(pipe, monkeypatch):
    mine = io.StringIO()
    monkeypatch.setattr(sys, "stdout", pipe.plain)
    monkeypatch.setattr(sys, "__stdout__", pipe.plain)
    monkeypatch.setattr(sys, "stderr", mine)  # as contextlib.redirect_stderr would
    assert output.install(1, 2) == ["stdout"]
    assert output.installed() and sys.stderr is mine
    assert sys.stdout.fileno() == pipe.w and sys.stdout.mode == pipe.plain.mode
    assert output.install(1, 2) == []  # once
    print("x", 1)
    assert pipe.writes == [b"x 1\n"]


@pytest.mark.unit
def test_whole_lines_in_a_world_of_several_ranks_or_when_tagging(pipe, monkeypatch):
    monkeypatch.setattr(sys, "stdout", pipe.plain)
    monkeypatch.setattr(sys, "__stdout__", pipe.plain)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert output.whole_lines({}) == []  # alone and untagged: left as it is
    assert output.whole_lines({"SPMD_RANK": "1", "SPMD_SIZE": "2", "SPMD_TAG_OUTPUT": "1"}) == ["stdout"]
    print("hi")
    assert pipe.read() == "[1] hi\n"


@pytest.mark.unit
def test_spmd_run_tells_the_ranks_it_prefixes_their_lines():
    base = {"SPMD_TAG_OUTPUT": "1"}
    assert child_env(0, 2, port=1, base=base, prefixed=True)["SPMD_TAG_OUTPUT"] == "0"
    assert child_env(0, 2, port=1, base=base)["SPMD_TAG_OUTPUT"] == "1"  # --no-prefix: the ranks tag


# -- real launchers: two ranks printing fast into one pipe --

LINES = 2000
PRINTER = textwrap.dedent("""
    import os, sys
    if sys.argv[1] == "init":  # through spmd.init, at the first use of comm
        from spmd import comm
        rank = comm.rank
    else:  # through python -m spmd, before the script runs
        rank = int(os.environ.get("RANK") or os.environ["SPMD_RANK"])
    for i in range(int(sys.argv[2])):
        print("rank", rank, "line", i, "x" * 30)
        if i % 100 == 0:
            print("rank", rank, "err", i, file=sys.stderr)
    print("rank", rank, "half", end="")
    print(" and half")
    if rank == 0:
        print("rank 0 bye", end="")  # no newline: written at exit
""")


def expected(size, n=LINES):
    lines = collections.Counter()
    for r in range(size):
        lines.update(f"rank {r} line {i} " + "x" * 30 for i in range(n))
        lines.update(f"rank {r} err {i}" for i in range(0, n, 100))
        lines[f"rank {r} half and half"] += 1
    return lines


def check_lines(out, size, tagged):
    """Assert out holds every expected line, whole, once (tagged '[rank] ' if asked); rank 0's bye too."""
    bye = "[0] rank 0 bye" if tagged else "rank 0 bye"
    assert bye in out, out[-2000:]
    lines = collections.Counter(out.replace(bye, "", 1).splitlines())
    want = expected(size)
    if tagged:
        want = collections.Counter({f"[{line.split()[1]}] {line}": k for line, k in want.items()})
    mixed = lines - want
    missing = want - lines
    assert not mixed and not missing, (
        f"{sum(mixed.values())} lines not whole or not expected, e.g. {list(mixed)[:3]}; "
        f"{sum(missing.values())} missing, e.g. {list(missing)[:3]}"
    )


@pytest.fixture
def printer(tmp_path):
    path = tmp_path / "printer.py"
    path.write_text(PRINTER)
    return path


@pytest.mark.launcher
@pytest.mark.timeout(120)
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found: pip install mpich")
def test_mpirun_unbuffered_lines_stay_whole(printer):
    env = clean_env(PYTHONUNBUFFERED=1)
    result = run([MPIRUN, "-n", 2, PY, printer, "init", LINES], 110, env)
    assert result.returncode == 0, result.stdout[-3000:]
    check_lines(result.stdout, 2, tagged=False)


@pytest.mark.launcher
@pytest.mark.timeout(150)
def test_torchrun_unbuffered_lines_stay_whole_and_tagged(printer):
    env = clean_env(PYTHONUNBUFFERED=1, SPMD_TAG_OUTPUT=1, OMP_NUM_THREADS=1)
    result = run([tool("torchrun"), "--nproc-per-node", 2, "-m", "spmd", printer, "init", LINES], 140, env)
    assert result.returncode == 0, result.stdout[-3000:]
    check_lines(result.stdout, 2, tagged=True)


@pytest.mark.launcher
@pytest.mark.timeout(60)
def test_spmd_run_does_not_tag_twice(printer):
    env = clean_env(SPMD_TAG_OUTPUT=1)
    result = run([tool("spmd"), "run", "-n", 2, printer, "runner", 50], 50, env)
    assert result.returncode == 0, result.stdout[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 2 * (50 + 1 + 1) + 1
    for line in lines:
        assert re.fullmatch(r"\[([01])\] rank \1 (line|err|half|bye).*", line), line
