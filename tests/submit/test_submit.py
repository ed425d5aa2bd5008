"""spmd submit without a cluster: golden batch files, quoting, validation, profiles, fake sbatch.

Golden files: tests/submit/golden/NAME.sbatch hold the batch file that ``render`` makes
for each case in GOLDEN. After an intended change to the batch file, rewrite them
with ``SPMD_REGEN_GOLDEN=1 pytest tests/submit/test_submit.py -k golden`` and review
the diff.
"""

import json
import os
import shlex
import signal
import stat
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from tests.support import finish, start

from spmd.runtime import preempt
from spmd.cli.submit import submit
from spmd.submit import profiles
from spmd.submit import sbatch as slurm
from spmd.submit.batch import directive, render
from spmd.submit.options import SubmitError, make, time_seconds

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).parent / "golden"
BASE = {"script": "jobs/scatter_gather.py", "python": "/opt/venv/bin/python",
        "chdir": "/home/me/project", "mpirun": "/opt/venv/bin/mpirun"}
NASTY = ["a b", "it's", 'say "hi"', "$(touch /tmp/pwned-spmd)", "`id`", "#not a comment",
         "a,b,c", "back\\slash", "tab\there", "semi;colon && echo x | y > z", "%x %j",
         "${HOME}", "new\nline", "", "ünïcødé"]

GOLDEN_CASES = {
    "minimal": {},
    "multinode": {"nodes": 4, "ntasks_per_node": 2, "time": "1:30:00", "partition": "cpu",
                  "account": "proj-42", "qos": "normal", "mem": "16g", "args": ["--rows", "1000"]},
    "mpi": {"ntasks": 8, "nodes": 2, "cpus_per_task": 2, "backend": "mpi",
            "constraint": "skylake&ib", "exclusive": True},
    "mpirun": {"ntasks": 5, "nodes": 2, "launcher": "mpirun", "backend": "mpi"},
    "gpu": {"nodes": 2, "ntasks_per_node": 4, "gpus_per_node": "a100:4", "backend": "nccl",
            "setup": ["module load cuda/12.4", "source /opt/venv/bin/activate"],
            "env": {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "8"}},
    "preempt": {"nodes": 2, "ntasks_per_node": 2, "time": "2-00:00:00", "requeue": True,
                "signal_before": 300, "args": ["--resume"]},
    "bookkeeping": {"array": "0-15%4", "dependency": "afterok:123", "mail_type": "END,FAIL",
                    "mail_user": "me@example.org", "error": "logs/%x-%A_%a.err",
                    "output": "logs/%x-%A_%a.out", "sbatch_options": ["--reservation=maint",
                                                                      "--hold"]},
    "quoting": {"job_name": "my job #1, \"fast\" $(x)", "output": "/scratch/my logs/%x-%j.out",
                "chdir": "/home/me/my project", "script": "my scripts/job's.py",
                "args": NASTY, "env": {"MSG": "multi\nline $(touch /tmp/pwned) 'q' #c,d"}},
    "module": {"module": True, "script": "mypkg.main", "ntasks": 2, "args": ["-x"]},
    "preflight": {"nodes": 3, "ntasks_per_node": 2, "preflight": True},
    "requeue": {"nodes": "2-3", "ntasks_per_node": 2, "requeue": True, "preflight": True,
                "args": ["--resume", "--output", "out.npy"]},
}


# -- golden files -------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_batch_file(name):
    text = render(make({**BASE, **GOLDEN_CASES[name]}))
    path = GOLDEN / f"{name}.sbatch"
    if os.environ.get("SPMD_REGEN_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: run SPMD_REGEN_GOLDEN=1 pytest {__file__} -k golden"
    expected = path.read_text().splitlines()
    for i, (got, want) in enumerate(zip(text.splitlines(), expected), 1):
        assert got == want, (f"{path.name} line {i} differs:\n got: {got}\nwant: {want}\n"
                             f"If the change is intended: SPMD_REGEN_GOLDEN=1 pytest {__file__}")
    assert len(text.splitlines()) == len(expected), f"{path.name}: line count differs"


def test_render_is_pure(tmp_path, monkeypatch):
    """The batch file depends on the options alone: not on the environment or the directory."""
    options = make({**BASE, **GOLDEN_CASES["quoting"]})
    for name in list(os.environ):
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SBATCH_PARTITION", "elsewhere")
    monkeypatch.chdir(tmp_path)
    assert render(options) == (GOLDEN / "quoting.sbatch").read_text()


# -- sbatch's #SBATCH parser, as in src/sbatch/opt.c (_get_argument) -----------------

def sbatch_parse(line):
    """Split an #SBATCH line into arguments the way sbatch does."""
    assert line.startswith("#SBATCH")
    rest, args = line[len("#SBATCH"):], []
    i = 0
    while True:
        while i < len(rest) and rest[i].isspace():
            i += 1
        if i >= len(rest):
            return args
        arg, quote, escape = "", None, False
        while i < len(rest) and (quote or not rest[i].isspace()) and rest[i] != "\n":
            c = rest[i]
            if escape:
                escape = False
            elif c == "\\":
                escape, i = True, i + 1
                continue
            elif quote:
                if c == quote:
                    quote, i = None, i + 1
                    continue
            elif c in "\"'":
                quote, i = c, i + 1
                continue
            elif c == "#":
                return args + ([arg] if arg else [])
            arg += c
            i += 1
        assert quote is None, f"unmatched quote in {line!r}"
        args.append(arg)


@pytest.mark.parametrize("value", [v for v in NASTY if v and "\n" not in v and "\t" not in v])
def test_directive_values_survive_sbatchs_parser(value):
    line = directive("job-name", value)
    assert "\n" not in line
    assert sbatch_parse(line) == [f"--job-name={value}"]


@pytest.mark.parametrize("value", ["two\nlines", "cr\rhere", "nul\0", "tab\there", "bell\a"])
def test_directive_refuses_what_it_cannot_hold(value):
    with pytest.raises(SubmitError, match="cannot be written in an #SBATCH directive"):
        directive("job-name", value)


def test_every_directive_of_the_quoting_case_parses_back():
    text = render(make({**BASE, **GOLDEN_CASES["quoting"]}))
    parsed = [a for line in text.splitlines() if line.startswith("#SBATCH")
              for a in sbatch_parse(line)]
    assert '--job-name=my job #1, "fast" $(x)' in parsed
    assert "--output=/scratch/my logs/%x-%j.out" in parsed
    assert "--chdir=/home/me/my project" in parsed


# -- the batch file under bash, with fake srun and scontrol ---------------------------

FAKE_SRUN = """#!{python}
import json, os, signal, sys, time
out = os.environ["FAKE_OUT"]
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
keys = ("MSG", "MASTER_ADDR", "SPMD_BACKEND", "SPMD_PREEMPT_SIGNAL", "RANK", "OMPI_COMM_WORLD_RANK")
record = {{"argv": sys.argv[1:], "env": {{k: os.environ.get(k) for k in keys}}}}
with open(out, "w") as f:
    json.dump(record, f)
if os.environ.get("FAKE_SLEEP"):
    deadline = time.time() + float(os.environ["FAKE_SLEEP"])
    while not got and time.time() < deadline:
        time.sleep(0.05)
    record["signals"] = got
    with open(out, "w") as f:
        json.dump(record, f)
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""
FAKE_SCONTROL = """#!/bin/sh
if [ "$1" = show ]; then echo node-a; echo node-b; exit 0; fi
echo "$@" >> "$FAKE_OUT.scontrol"
"""


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN.format(python=sys.executable)),
                       ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_OUT": str(tmp_path / "out"),
           "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2", "SLURM_TASKS_PER_NODE": "2(x2)",
           "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_ID": "77", "HOME": str(tmp_path),
           "RANK": "5", "OMPI_COMM_WORLD_RANK": "3"}
    return tmp_path, env


def run_batch(tmp_path, env, options, **extra):
    path = tmp_path / "job.sbatch"
    path.write_text(render(make({**BASE, "chdir": str(tmp_path), **options})))
    return start(["bash", path], {**env, **extra}, cwd=tmp_path)  # its own session: killable


@pytest.mark.timeout(30)
def test_batch_file_passes_values_intact_and_runs_none(fake_slurm):
    tmp_path, env = fake_slurm
    marker = tmp_path / "pwned"
    nasty = [v.replace("/tmp/pwned-spmd", str(marker)) for v in NASTY]
    msg = f"multi\nline $(touch {marker}) `touch {marker}` 'q' #c,d"
    options = {"nodes": 2, "ntasks_per_node": 2, "backend": "gloo", "args": nasty,
               "env": {"MSG": msg}, "script": "dir with space/job's.py"}
    proc = run_batch(tmp_path, env, options)
    out = finish(proc, 20, "the batch file").stdout
    assert proc.returncode == 0, out
    record = json.loads((tmp_path / "out").read_text())
    assert record["argv"] == ["--kill-on-bad-exit=1", "/opt/venv/bin/python", "-m", "spmd",
                              "dir with space/job's.py", *nasty]
    assert record["env"]["MSG"] == msg
    assert record["env"]["MASTER_ADDR"] == "node-a"
    assert record["env"]["SPMD_BACKEND"] == "gloo"
    assert record["env"]["RANK"] is None and record["env"]["OMPI_COMM_WORLD_RANK"] is None
    assert not marker.exists()


@pytest.mark.timeout(30)
def test_batch_file_refuses_a_world_it_did_not_ask_for(fake_slurm):
    tmp_path, env = fake_slurm
    proc = run_batch(tmp_path, env, {"nodes": 2, "ntasks_per_node": 2}, SLURM_NTASKS="3",
                     SLURM_TASKS_PER_NODE="2,1")
    out = finish(proc, 20, "the batch file").stdout
    assert proc.returncode == 2
    assert "expects 4 tasks on 2 nodes, 2 per node" in out and "SLURM_NTASKS=3" in out
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(30)
def test_batch_file_forwards_the_preemption_signal_and_requeues(fake_slurm):
    tmp_path, env = fake_slurm
    proc = run_batch(tmp_path, env, {"nodes": 2, "ntasks_per_node": 2, "time": "10",
                                     "signal_before": 60, "requeue": True},
                     FAKE_SLEEP="15", FAKE_EXIT="0")
    deadline = time.monotonic() + 10
    while not (tmp_path / "out").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # the fake srun sets its handler first thing
    proc.send_signal(signal.SIGUSR1)
    out = finish(proc, 20, "the batch file").stdout
    assert proc.returncode == 0, out
    record = json.loads((tmp_path / "out").read_text())
    assert record["signals"] == [signal.SIGUSR1]
    assert record["env"]["SPMD_PREEMPT_SIGNAL"] == "USR1"
    assert (tmp_path / "out.scontrol").read_text().split() == ["requeue", "77"]
    assert "SIGUSR1 received" in out and "requeueing job 77" in out


RANGE = {"nodes": "2-3", "ntasks_per_node": 2, "requeue": True}


@pytest.mark.timeout(30)
def test_a_node_range_runs_on_the_nodes_slurm_gave(fake_slurm):
    """--nodes 2-3: a requeued job that SLURM gave 2 nodes (one failed) starts 2 tasks on each of them."""
    tmp_path, env = fake_slurm
    proc = run_batch(tmp_path, env, RANGE, SLURM_NTASKS="", SLURM_TASKS_PER_NODE="2(x2)",
                     SLURM_RESTART_COUNT="1")
    out = finish(proc, 20, "the batch file").stdout
    assert proc.returncode == 0, out
    assert json.loads((tmp_path / "out").read_text())["argv"][:2] == ["--kill-on-bad-exit=1",
                                                                     "--ntasks-per-node=2"]
    assert "spmd: 2 nodes (node-[a-b]), 4 tasks, requeue number 1" in out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("nodes, ntasks", [("1", ""), ("4", ""), ("", ""), ("3", "6")])
def test_a_node_range_refuses_a_world_outside_it(fake_slurm, nodes, ntasks):
    """Fewer or more nodes than the range, or a task count (which makes SLURM give the fewest nodes)."""
    tmp_path, env = fake_slurm
    proc = run_batch(tmp_path, env, RANGE, SLURM_JOB_NUM_NODES=nodes, SLURM_NTASKS=ntasks)
    out = finish(proc, 20, "the batch file").stdout
    assert proc.returncode == 2, out
    assert f"expects 2-3 nodes and no task count, but SLURM gave SLURM_JOB_NUM_NODES={nodes or 'unset'}" in out
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(30)
def test_batch_file_exits_with_the_launchers_code(fake_slurm):
    tmp_path, env = fake_slurm
    proc = run_batch(tmp_path, env, {"nodes": 2, "ntasks_per_node": 2, "signal_before": 60},
                     FAKE_EXIT="3")
    finish(proc, 20, "the batch file")
    assert proc.returncode == 3
    assert not (tmp_path / "out.scontrol").exists()


# -- option validation ---------------------------------------------------------------

@pytest.mark.parametrize("text,seconds", [
    ("90", 5400), ("0", 0), ("5:30", 330), ("1:30:00", 5400), ("2-0", 172800),
    ("1-12:30", 131400), ("1-00:00:01", 86401), ("UNLIMITED", None), ("infinite", None)])
def test_time_formats(text, seconds):
    assert time_seconds(text) == seconds


@pytest.mark.parametrize("text", ["1h", "1:60", "1:2:3:4", "25-", "1-24", "1:00:60", "-5", ""])
def test_bad_times_are_refused(text):
    with pytest.raises(SubmitError, match="--time"):
        make({**BASE, "time": text})


@pytest.mark.parametrize("values,match", [
    ({"mem": "16GB"}, "not a memory size"),
    ({"mem": "lots"}, "not a memory size"),
    ({"mem": "4G", "mem_per_cpu": "1G"}, "mutually exclusive"),
    ({"nodes": 0}, "at least 1"),
    ({"ntasks": "two"}, "whole number"),
    ({"cpus_per_task": -1}, "at least 1"),
    ({"ntasks": 7, "ntasks_per_node": 2}, "not a multiple"),
    ({"ntasks": 8, "nodes": 3, "ntasks_per_node": 2}, "give two of the three"),
    ({"ntasks": 2, "nodes": 3}, "more nodes than"),
    ({"gpus_per_node": "4", "gres": "gpu:4"}, "both ask for GPUs"),
    ({"gpus_per_node": "four"}, "TYPE:COUNT"),
    ({"signal_before": 600, "time": "10"}, "not shorter than"),
    ({"signal_before": 70000}, "at most 65535"),
    ({"preempt_signal": "KILL"}, "preempt-signal"),
    ({"mail_type": "END,SOMETIMES"}, "unknown SOMETIMES"),
    ({"array": "1-"}, "--array"),
    ({"partition": "a b"}, "--partition"),
    ({"env": ["1BAD=x"]}, "environment variable name"),
    ({"env": ["JUSTNAME"]}, "NAME=VALUE"),
    ({"setup": ["one\ntwo"]}, "one --setup per line"),
    ({"job_name": "a/b"}, "without '/'"),
    ({"sbatch_options": ["reservation=x"]}, "one sbatch option"),
    ({"backend": "tcp"}, "--backend"),
    ({"launcher": "mpirun", "mpi": "pmi2"}, "srun option"),
    ({"bogus": 1}, "unknown option 'bogus'"),
    ({"nodes": "3-2"}, "MIN-MAX with 1 <= MIN <= MAX"),
    ({"nodes": "0-2"}, "MIN-MAX with 1 <= MIN <= MAX"),
    ({"nodes": "2-x"}, "whole number"),
    ({"nodes": "2-3", "ntasks": 6}, "give that instead of --ntasks"),
    ({"nodes": "2-3", "launcher": "mpirun"}, "a node range needs srun"),
    ({"max_nodes": 3}, "give --nodes MIN-MAX"),
])
def test_bad_options_are_refused_clearly(values, match):
    with pytest.raises(SubmitError, match=match):
        make({**BASE, **values})


def test_layouts_resolve_to_a_world():
    assert make({**BASE}).world == 1
    o = make({**BASE, "nodes": 4, "ntasks_per_node": 2})
    assert (o.nodes, o.ntasks, o.ntasks_per_node) == (4, 8, 2)
    o = make({**BASE, "ntasks": 8, "ntasks_per_node": 4})
    assert (o.nodes, o.ntasks, o.ntasks_per_node) == (2, 8, 4)
    o = make({**BASE, "ntasks": 5, "nodes": 2})
    assert (o.nodes, o.ntasks, o.ntasks_per_node) == (2, 5, None)
    assert make({**BASE, "mem": "16g"}).mem == "16G"
    o = make({**BASE, "nodes": "2-3", "ntasks_per_node": 4})
    assert (o.nodes, o.max_nodes, o.ntasks, o.ntasks_per_node, o.node_range) == (2, 3, 8, 4, "2-3")
    o = make({**BASE, "nodes": " 2 - 3 "})
    assert (o.nodes, o.max_nodes, o.ntasks_per_node) == (2, 3, 1)
    o = make({**BASE, "nodes": "3-3"})
    assert (o.nodes, o.max_nodes, o.node_range) == (3, None, "3")


def test_notes_for_doubtful_but_valid_choices():
    assert any("nccl" in n for n in make({**BASE, "backend": "nccl"}).notes)
    assert any("no warning" in n for n in make({**BASE, "requeue": True}).notes)
    assert any("--nodes=2-3 lets it start on the nodes left" in n
               for n in make({**BASE, "nodes": 3, "requeue": True}).notes)
    assert not any("nodes left" in n for n in make({**BASE, "nodes": "2-3", "requeue": True}).notes)
    assert make({**BASE, "backend": "mpi"}).srun_mpi == "pmi2"
    assert make({**BASE, "backend": "gloo"}).srun_mpi is None


# -- profiles ------------------------------------------------------------------------

def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_profiles_merge_user_then_project_then_command_line(tmp_path):
    user = write(tmp_path / "home/.config/spmd/submit.toml", """
        [profile.default]
        partition = "cpu"
        time = "1:00:00"
        setup = ["module load a"]
        env = { A = "1", B = "2" }
        [profile.gpu]
        gpus-per-node = 4
        """)
    project = write(tmp_path / "proj/spmd-submit.toml", """
        [profile.default]
        time = "30"
        ntasks_per_node = 2
        setup = ["module load b"]
        env = { B = "3" }
        """)
    layer, sources = profiles.load(None, [user, project])
    assert len(sources) == 2
    merged = profiles.merge(layer, {"time": "5", "setup": ("echo c",), "env": (("C", "4"),)})
    assert merged["partition"] == "cpu" and merged["time"] == "5"
    assert merged["ntasks_per_node"] == 2
    assert merged["setup"] == ("module load a", "module load b", "echo c")
    assert dict(merged["env"]) == {"A": "1", "B": "3", "C": "4"}
    gpu, _ = profiles.load("gpu", [user, project])
    assert gpu == {"gpus_per_node": "4"}


def test_profile_errors_name_the_file_and_profile(tmp_path):
    bad = write(tmp_path / "spmd-submit.toml", """
        [profile.x]
        time = "soon"
        """)
    with pytest.raises(SubmitError, match=r"spmd-submit.toml \[profile.x\]: --time='soon'"):
        profiles.load("x", [bad])
    with pytest.raises(SubmitError, match="no profile 'y'.*profiles found: x"):
        profiles.load("y", [bad])
    unknown = write(tmp_path / "u.toml", "[profile.x]\nnodez = 2\n")
    with pytest.raises(SubmitError, match="unknown option 'nodez'"):
        profiles.load("x", [unknown])
    script = write(tmp_path / "s.toml", "[profile.x]\nscript = 'a.py'\n")
    with pytest.raises(SubmitError, match="cannot be set in a profile"):
        profiles.load("x", [script])
    broken = write(tmp_path / "b.toml", "[profile.x\n")
    with pytest.raises(SubmitError, match="cannot read"):
        profiles.load("x", [broken])
    assert profiles.load(None, []) == ({}, [])


def test_profile_files_are_found(tmp_path):
    env = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": ""}
    assert profiles.user_file(env) == tmp_path / "home/.config/spmd/submit.toml"
    assert profiles.user_file({"XDG_CONFIG_HOME": "/x"}) == Path("/x/spmd/submit.toml")
    project = write(tmp_path / "proj/spmd-submit.toml", "")
    (tmp_path / "proj/sub/dir").mkdir(parents=True)
    assert profiles.project_file(tmp_path / "proj/sub/dir") == project


# -- sbatch's output -----------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("123\n", ("123", None)), ("123;clusterA\n", ("123", "clusterA")),
    ("sbatch: warning: x\n4567\n", ("4567", None))])
def test_job_id_parsing(text, expected):
    assert slurm.parse_job_id(text) == expected


@pytest.mark.parametrize("text", ["", "Submitted batch job 12\n", "12a\n"])
def test_job_id_parsing_refuses_other_output(text):
    with pytest.raises(SubmitError, match="cannot find a job id"):
        slurm.parse_job_id(text)


SCONTROL_SHOW_JOB = """JobId=9 JobName=my job ExitCode=9:9 JobState=COMPLETED
   UserId=root(0) GroupId=root(0) MCS_label=N/A
   JobState=FAILED Reason=NonZeroExitCode Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=1:0
   NodeList=127.0.0.[2-3]
   StdErr=/tmp/exp/logs/my job-9.out
   StdIn=/dev/null
   StdOut=/tmp/exp/logs/my job-9.out
   Power=

JobId=11 ArrayJobId=10 ArrayTaskId=1 JobName=arr
   JobState=CANCELLED Reason=None Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:15
   StdOut=/tmp/o
"""


def test_scontrol_records_and_exit_status():
    a, b = slurm._scontrol_records(SCONTROL_SHOW_JOB)
    assert (a.job_id, a.state, a.exit_code, a.signal) == ("9", "FAILED", 1, 0)
    assert a.stdout == "/tmp/exp/logs/my job-9.out" and a.final
    assert (b.job_id, b.state, b.signal) == ("10_1", "CANCELLED", 15)
    assert slurm.exit_status([a, b]) == 1
    assert slurm.exit_status([b]) == 128 + 15
    assert slurm.exit_status([slurm.JobState("1", "TIMEOUT")]) == 1
    assert slurm.exit_status([slurm.JobState("1", "COMPLETED")]) == 0


def test_output_patterns_expand():
    assert slurm.expand_pattern("logs/%x-%j.out", "12", "job", "me") == "logs/job-12.out"
    assert slurm.expand_pattern("100%%-%u", "1", "j", "me") == "100%-me"
    assert slurm.expand_pattern("logs/%N.out", "1", "j") is None


# -- the command, with a fake sbatch ------------------------------------------------

FAKE_SBATCH = """#!/bin/sh
echo "$@" >> "$FAKE_LOG"
if [ "$1" = --test-only ]; then
    if [ -n "$FAKE_REJECT" ]; then echo "sbatch: error: $FAKE_REJECT" >&2; exit 1; fi
    echo "sbatch: Job 4241 to start at 2030-01-01T00:00:00 using 1 processors on nodes n1 in partition debug" >&2
    exit 0
fi
echo "4242;clusterA"
"""
FAKE_SCONTROL_SHOW = """#!/bin/sh
cat <<EOF
JobId=4242 JobName=job
   JobState=COMPLETED Reason=None Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=${FAKE_CODE:-0}:0
   StdOut=$FAKE_STDOUT
EOF
"""


@pytest.fixture
def fake_sbatch(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("scontrol", FAKE_SCONTROL_SHOW)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    (tmp_path / "job.py").write_text("print('hi')\n")
    (tmp_path / "job.log").write_text("".join(f"line {i}\n" for i in range(50)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "sbatch.log"))
    monkeypatch.setenv("FAKE_STDOUT", str(tmp_path / "job.log"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    for name in [k for k in os.environ if k.startswith("SBATCH_")]:
        monkeypatch.delenv(name)
    return tmp_path


def invoke(*args):
    return CliRunner().invoke(submit, list(args), catch_exceptions=False)


def test_submission_prints_the_id_and_records_it(fake_sbatch, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/spmd", "submit", "-n", "2", "job.py", "a b"])
    result = invoke("-n", "2", "job.py", "a b")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == "4242"
    calls = (fake_sbatch / "sbatch.log").read_text().splitlines()
    assert calls[0].startswith("--test-only ") and calls[1].startswith("--parsable ")
    (record_path,) = (fake_sbatch / "logs/submit").glob("*.json")
    record = json.loads(record_path.read_text())
    batch = Path(record["batch_file"])
    assert record["job_id"] == "4242" and record["cluster"] == "clusterA"
    assert record["submit_command"] == ["spmd", "submit", "-n", "2", "job.py", "a b"]
    assert record["sbatch_command"] == ["sbatch", "--parsable", str(batch.relative_to(fake_sbatch))]
    import hashlib
    assert record["sha256"] == hashlib.sha256(batch.read_bytes()).hexdigest()
    assert "job.py 'a b'" in batch.read_text()
    assert (fake_sbatch / "logs").is_dir()


def test_wait_shows_the_log_tail_and_exits_with_the_jobs_code(fake_sbatch, monkeypatch):
    monkeypatch.setenv("FAKE_CODE", "3")
    result = invoke("--wait", "--tail", "5", "job.py")
    assert result.exit_code == 3
    assert "line 49" in result.stdout and "line 44" not in result.stdout
    assert "job 4242 COMPLETED, exit code 3:0" in result.output


def test_preflight_rejection_stops_the_submission(fake_sbatch, monkeypatch):
    monkeypatch.setenv("FAKE_REJECT", "Requested node configuration is not available")
    result = invoke("-N", "64", "job.py")
    assert result.exit_code == 1
    assert "Requested node configuration is not available" in result.output
    assert "not submitted" in result.output
    assert len((fake_sbatch / "sbatch.log").read_text().splitlines()) == 1


def test_test_only_is_on_by_default_and_off_with_no_preflight_or_no_test_only(fake_sbatch, monkeypatch):
    monkeypatch.setenv("FAKE_REJECT", "Requested node configuration is not available")
    assert invoke("-N", "64", "job.py").exit_code == 1
    assert invoke("--preflight", "-N", "64", "job.py").exit_code == 1  # the doctor step adds to the check
    assert invoke("--no-preflight", "-N", "64", "job.py").exit_code == 0
    assert invoke("--no-test-only", "-N", "64", "job.py").exit_code == 0


def test_preflight_puts_the_doctor_before_the_job_and_only_then():
    with_it = render(make({**BASE, "nodes": 2, "preflight": True}))
    doctor = "srun --kill-on-bad-exit=1 --mpi=none --nodes=2 --ntasks=2 --ntasks-per-node=1 " \
             "/opt/venv/bin/python -m spmd.doctor"
    assert f"if ! {doctor}; then" in with_it
    assert with_it.index("spmd.doctor") < with_it.index("exec srun")
    assert "spmd.doctor" not in render(make(dict(BASE, nodes=2)))
    over_mpirun = render(make({**BASE, "nodes": 2, "ntasks": 4, "launcher": "mpirun", "preflight": True}))
    assert "/opt/venv/bin/mpirun -n 2 -ppn 1 /opt/venv/bin/python -m spmd.doctor" in over_mpirun


def test_sbatch_variables_are_reported(fake_sbatch, monkeypatch):
    monkeypatch.setenv("SBATCH_TIMELIMIT", "5")
    result = invoke("job.py")
    assert result.exit_code == 0
    assert "SBATCH_TIMELIMIT=5 is set and overrides" in result.output


def test_dry_run_prints_the_file_and_the_command_only(fake_sbatch):
    result = invoke("--dry-run", "-N", "2", "--ntasks-per-node", "2", "--python", "py",
                    "job.py", "--x")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("#!/bin/bash\n")
    assert "exec srun --kill-on-bad-exit=1 py -m spmd job.py --x" in result.stdout
    assert "# sbatch command: sbatch --parsable logs/submit/job-" in result.stdout
    assert not (fake_sbatch / "sbatch.log").exists()
    assert not (fake_sbatch / "logs").exists()


def test_a_node_range_from_the_command_line(fake_sbatch):
    """-N 2-3: the range, CPUs for the tasks of a node, no task count; srun starts them on every node."""
    result = invoke("--dry-run", "-N", "2-3", "--ntasks-per-node", "2", "-c", "3", "--requeue",
                    "--python", "py", "job.py")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert {"#SBATCH --nodes=2-3", "#SBATCH --mincpus=6", "#SBATCH --cpus-per-task=3",
            "#SBATCH --requeue"} <= set(lines)
    assert not [line for line in lines if line.startswith(("#SBATCH --ntasks", "#SBATCH --ntasks-per-node"))]
    assert "exec srun --kill-on-bad-exit=1 --ntasks-per-node=2 --cpus-per-task=3 py -m spmd job.py" in lines


def test_profile_and_command_line_reach_the_file(fake_sbatch):
    write(fake_sbatch / "spmd-submit.toml", """
        [profile.default]
        partition = "cpu"
        [profile.big]
        partition = "big"
        nodes = 8
        env = { X = "1" }
        """)
    out = invoke("--dry-run", "job.py").stdout
    assert "#SBATCH --partition=cpu" in out
    out = invoke("--dry-run", "--profile", "big", "--nodes", "2", "--env", "Y=2", "job.py").stdout
    assert "#SBATCH --partition=big" in out and "#SBATCH --nodes=2" in out
    assert "export X=1\nexport Y=2" in out


@pytest.mark.parametrize("args,match", [
    (["-J", "two\nlines", "job.py"], "contains a newline"),
    (["--output", "logs/%x\n.out", "job.py"], "contains a newline"),
    (["--env", "bad name=1", "job.py"], "environment variable name"),
    (["missing.py"], "no such file"),
    (["--time", "1h", "job.py"], "not a SLURM time"),
])
def test_refusals_are_clear_and_submit_nothing(fake_sbatch, args, match):
    result = invoke(*args)
    assert result.exit_code == 1 and match in result.output, result.output
    assert not (fake_sbatch / "sbatch.log").exists()


def test_arguments_with_newlines_are_kept(fake_sbatch):
    out = invoke("--dry-run", "--python", "py", "job.py", "a\nb", "$(x)").stdout
    command = out.split("\nexec ", 1)[1].split("\n# sbatch command")[0]
    assert shlex.split(command)[-2:] == ["a\nb", "$(x)"]


# -- spmd.preempt --------------------------------------------------------------------

@pytest.fixture
def clean_preempt(monkeypatch):
    monkeypatch.delenv("SPMD_PREEMPT_SIGNAL", raising=False)
    preempt.reset()
    yield
    preempt.reset()


def _signal_self(signum=signal.SIGUSR1):
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # Python runs the handler at the next bytecode


def test_preempt_callbacks_run_once_in_order(clean_preempt, capsys):
    calls = []
    preempt.on_preempt(lambda: calls.append("a"))
    preempt.on_preempt(lambda: 1 / 0)
    preempt.on_preempt(lambda: calls.append("b"))
    assert not preempt.preempted()
    _signal_self()
    _signal_self()
    assert calls == ["a", "b"] and preempt.preempted()
    assert "ZeroDivisionError" in capsys.readouterr().err
    preempt.on_preempt(lambda: calls.append("late"))
    assert calls == ["a", "b", "late"]
    assert preempt.any_preempted(FakeComm())


class FakeComm:
    def all_reduce(self, x, op="sum"):
        assert op == "max"
        return x


def test_preempt_signal_is_configurable(clean_preempt, monkeypatch):
    monkeypatch.setenv("SPMD_PREEMPT_SIGNAL", "SIGUSR2")
    assert preempt.signal_number() == signal.SIGUSR2
    assert preempt.signal_number("term") == signal.SIGTERM
    assert preempt.signal_number("10") == 10
    with pytest.raises(ValueError, match="unknown signal 'NOPE'"):
        preempt.signal_number("NOPE")
    assert preempt.install() == signal.SIGUSR2
    with pytest.raises(ValueError, match="already handles"):
        preempt.install("USR1")
    _signal_self(signal.SIGUSR2)
    assert preempt.preempted()


def test_an_explicit_signal_stays_for_later_calls(clean_preempt, monkeypatch):
    monkeypatch.delenv("SPMD_PREEMPT_SIGNAL", raising=False)
    assert preempt.install("USR2") == signal.SIGUSR2
    assert preempt.install() == signal.SIGUSR2  # not the default USR1: no "already handles"
    assert not preempt.preempted()
    _signal_self(signal.SIGUSR2)
    assert preempt.preempted()


def test_preempt_reset_restores_the_previous_handler(clean_preempt):
    before = signal.getsignal(signal.SIGUSR1)
    preempt.install()
    assert signal.getsignal(signal.SIGUSR1) is not before
    preempt.reset()
    assert signal.getsignal(signal.SIGUSR1) == before
