"""The batch file, as a pure function of SubmitOptions: ``render(options) -> str``.

Two parsers read the file, and every value is quoted for the one that reads it:

- sbatch's ``#SBATCH`` parser reads the directives. It splits at blanks, ends the
  line at an unquoted ``#``, and takes '...' or "..." quotes and backslash
  escapes. Values that are not plain words are written in double quotes with
  ``\\`` and ``"`` escaped. A newline (which would end the directive) or another
  control character cannot be written there: ``directive`` refuses it with
  SubmitError. The directives are comments to bash, so nothing in them runs.
- bash reads the rest. Values (environment, script, arguments, paths) are
  quoted with shlex.quote, which keeps every character, newlines included,
  and expands nothing. sbatch stops reading directives at the first command
  (``set -e`` below), so a value in the body can never act as a directive.

The ``setup`` lines are the one exception: they are shell code, run as given.
"""

from __future__ import annotations

import re
import shlex

from spmd.submit.options import SubmitError, SubmitOptions

__all__ = ["render", "directive", "launch_argv", "LAUNCHER_VARIABLES"]

_PLAIN = re.compile(r"[A-Za-z0-9_%.,:/@+=-]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

#: Variables a launcher sets, unset in the job: sbatch exports the submitting
#: shell's environment, and a leftover rank or address there would misplace every task.
LAUNCHER_VARIABLES = (
    "RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE MASTER_ADDR "
    "MASTER_PORT TORCHELASTIC_RUN_ID SPMD_RANK SPMD_SIZE SPMD_LOCAL_RANK SPMD_LOCAL_SIZE "
    "SPMD_NODE_RANK SPMD_NUM_NODES SPMD_LISTEN_FD PMI_RANK PMI_SIZE PMI_FD MPI_LOCALRANKID "
    "MPI_LOCALNRANKS SPMD_SECRET"
).split()
_LAUNCHER_PREFIXES = ("OMPI_COMM_WORLD_", "MV2_COMM_WORLD_", "PMIX_")


def directive(option: str, value: str | None = None) -> str:
    """Return one '#SBATCH --option=value' line, the value quoted for sbatch's parser."""
    if value is None:
        return f"#SBATCH --{option}"
    if _CONTROL.search(value):
        what = "a newline" if "\n" in value or "\r" in value else "a control character"
        raise SubmitError(
            f"--{option}={value!r} contains {what}, which cannot be written in an #SBATCH "
            "directive (a newline would end it and the rest would be lost or misread): "
            "remove it")
    if _PLAIN.fullmatch(value):
        return f"#SBATCH --{option}={value}"
    quoted = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'#SBATCH --{option}="{quoted}"'


def _raw(option: str) -> str:
    """Return a directive for a raw sbatch option such as --reservation=NAME."""
    name, sep, value = option.lstrip("-").partition("=")
    return directive(name, value if sep else None)


def _directives(o: SubmitOptions) -> list[str]:
    out = [directive("job-name", o.name), directive("nodes", o.node_range)]
    if o.max_nodes:
        # A node range: no task count, else SLURM gives the fewest nodes that hold it; CPUs per
        # node instead, and srun starts --ntasks-per-node tasks on each node given.
        cpus = o.ntasks_per_node * (o.cpus_per_task or 1)
        out += [directive("mincpus", str(cpus))] if cpus > 1 else []
    else:
        out.append(directive("ntasks", str(o.ntasks)))
        if o.ntasks_per_node:
            out.append(directive("ntasks-per-node", str(o.ntasks_per_node)))
    pairs = [("cpus-per-task", o.cpus_per_task), ("gpus-per-node", o.gpus_per_node),
             ("gres", o.gres), ("mem", o.mem), ("mem-per-cpu", o.mem_per_cpu),
             ("time", o.time), ("partition", o.partition), ("account", o.account),
             ("qos", o.qos), ("constraint", o.constraint), ("output", o.output),
             ("error", o.error), ("chdir", o.chdir), ("array", o.array),
             ("dependency", o.dependency), ("mail-type", o.mail_type),
             ("mail-user", o.mail_user)]
    out += [directive(k, str(v)) for k, v in pairs if v is not None]
    if o.exclusive:
        out.append(directive("exclusive"))
    if o.requeue:
        out += [directive("requeue"), directive("open-mode", "append")]
    if o.signal_before is not None:
        out.append(directive("signal", f"B:{_signal(o)}@{o.signal_before}"))
    out += [_raw(option) for option in o.sbatch_options]
    return out


def _signal(o: SubmitOptions) -> str:
    return o.preempt_signal.upper().removeprefix("SIG")


def launch_argv(o: SubmitOptions) -> list[str]:
    """Return the command line that starts the ranks inside the allocation."""
    if o.launcher == "mpirun":
        argv = [o.mpirun, "-n", str(o.ntasks)]
    else:
        argv = ["srun", "--kill-on-bad-exit=1"]
        if o.max_nodes:  # a node range: so many tasks on each node SLURM gave
            argv.append(f"--ntasks-per-node={o.ntasks_per_node}")
        if o.srun_mpi:
            argv.append(f"--mpi={o.srun_mpi}")
        if o.cpus_per_task:  # srun 22.05 no longer takes it from the allocation
            argv.append(f"--cpus-per-task={o.cpus_per_task}")
    target = ["-m", o.script] if o.module else [o.script]
    return argv + [o.python, "-m", "spmd", *target, *o.args]


def doctor_argv(o: SubmitOptions) -> list[str]:
    """The preflight step: spmd doctor, one task on each node, through the job's launcher (never MPI
    under srun: the doctor needs none, and the pair check is what it is for)."""
    if o.launcher == "mpirun":
        return [o.mpirun, "-n", str(o.nodes), "-ppn", "1", o.python, "-m", "spmd.doctor"]
    counts = [] if o.max_nodes else [f"--nodes={o.nodes}", f"--ntasks={o.nodes}"]  # a range: every node given
    return ["srun", "--kill-on-bad-exit=1", "--mpi=none", *counts, "--ntasks-per-node=1", o.python, "-m",
            "spmd.doctor"]


def _preflight(o: SubmitOptions) -> list[str]:
    if not o.preflight:
        return []
    return ["# Preflight (--preflight): every node and every pair of nodes checked before the job runs.",
            f"if ! {shlex.join(doctor_argv(o))}; then",
            '    echo "spmd: the preflight failed (spmd doctor\'s table above); the job did not start" >&2',
            "    exit 1",
            "fi"]


def _world_check(o: SubmitOptions) -> list[str]:
    if o.max_nodes:
        return _range_check(o)
    tests = [f'[ "${{SLURM_NTASKS:-}}" != {o.ntasks} ]',
             f'[ "${{SLURM_JOB_NUM_NODES:-}}" != {o.nodes} ]']
    layout = f"{_plural(o.ntasks, 'task')} on {_plural(o.nodes, 'node')}"
    if o.ntasks_per_node:
        per_node = f"{o.ntasks_per_node}(x{o.nodes})" if o.nodes > 1 else str(o.ntasks_per_node)
        tests.append(f'[ "${{SLURM_TASKS_PER_NODE:-}}" != {shlex.quote(per_node)} ]')
        layout += f", {o.ntasks_per_node} per node"
    got = ("SLURM_NTASKS=${SLURM_NTASKS:-unset} SLURM_JOB_NUM_NODES=${SLURM_JOB_NUM_NODES:-unset} "
           "SLURM_TASKS_PER_NODE=${SLURM_TASKS_PER_NODE:-unset}")
    return [
        "# The allocation must be the world this file asks for: SBATCH_* variables and",
        "# sbatch's command-line options override the directives above.",
        f"if {' || '.join(tests)}; then",
        f'    echo "spmd: this job expects {layout}, but SLURM gave {got}: an SBATCH_*'
        ' variable or a sbatch option overrode the directives" >&2',
        "    exit 2",
        "fi",
    ]


def _range_check(o: SubmitOptions) -> list[str]:
    """The world check for a node range: MIN to MAX nodes, ntasks_per_node tasks on each."""
    per = o.ntasks_per_node
    return [
        "# The allocation must be the world this file asks for: SBATCH_* variables and",
        "# sbatch's command-line options override the directives above.  A node range:",
        "# the world is the nodes SLURM gave (fewer after a requeue that left a node out).",
        'spmd_nodes="${SLURM_JOB_NUM_NODES:-0}"',
        f'if ! [ "$spmd_nodes" -ge {o.nodes} ] 2>/dev/null || [ "$spmd_nodes" -gt {o.max_nodes} ] || '
        '[ -n "${SLURM_NTASKS:-}" ]; then',
        f'    echo "spmd: this job expects {o.node_range} nodes and no task count, but SLURM gave'
        ' SLURM_JOB_NUM_NODES=${SLURM_JOB_NUM_NODES:-unset} SLURM_NTASKS=${SLURM_NTASKS:-unset}:'
        ' an SBATCH_* variable or a sbatch option overrode the directives" >&2',
        "    exit 2",
        "fi",
        f'echo "spmd: $spmd_nodes nodes ($SLURM_JOB_NODELIST), $(({per} * spmd_nodes)) tasks'
        '${SLURM_RESTART_COUNT:+, requeue number $SLURM_RESTART_COUNT}" >&2',
    ]


def _environment(o: SubmitOptions) -> list[str]:
    unset = " ".join(LAUNCHER_VARIABLES)
    prefixes = " ".join(f'"${{!{p}@}}"' for p in _LAUNCHER_PREFIXES)
    out = [
        "# Launcher variables from the submitting shell would misplace the tasks.",
        f"unset {unset}",
        f"for spmd_var in {prefixes}; do unset \"$spmd_var\"; done",
        "# The rendezvous address: the first node of the allocation.",
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "export MASTER_ADDR PYTHONUNBUFFERED=1",
        "# The job's secret, asked of every connection to rank 0's store: made here, never written down.",
        "SPMD_SECRET=\"$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n')\"",
        "export SPMD_SECRET",
    ]
    if o.backend != "auto":
        out.append(f"export SPMD_BACKEND={o.backend}")
    if o.signal_before is not None:
        out.append(f"export SPMD_PREEMPT_SIGNAL={_signal(o)}")
    for name, value in o.env:
        out.append(f"export {name}={shlex.quote(value)}")
    return out


def _setup(o: SubmitOptions) -> list[str]:
    if not o.setup:
        return []
    return ["# Setup, run as given (--setup); the job stops if a line fails.",
            "set -e", *o.setup, "set +e"]


def _launch(o: SubmitOptions) -> list[str]:
    command = shlex.join(launch_argv(o))
    if o.signal_before is None:
        return [f"exec {command}"]
    sig = _signal(o)
    out = [
        f"# SLURM sends SIG{sig} to this shell {o.signal_before} s before the time limit;",
        "# it goes on to every task (spmd.preempt runs the job's hooks).",
        "spmd_preempted=0",
        "spmd_step=",
        f"trap 'spmd_preempted=1; echo \"spmd: SIG{sig} received, passing it to the tasks\" >&2; "
        f"[ -n \"$spmd_step\" ] && kill -{sig} \"$spmd_step\"' {sig}",
        f"{command} &",
        "spmd_step=$!",
        "while :; do",
        '    wait "$spmd_step"',
        "    spmd_status=$?",
        '    kill -0 "$spmd_step" 2>/dev/null || break  # wait returns early for a trapped signal',
        "done",
    ]
    if o.requeue:
        out += [
            'if [ "$spmd_preempted" = 1 ]; then',
            '    echo "spmd: requeueing job $SLURM_JOB_ID after the preemption signal" >&2',
            '    scontrol requeue "$SLURM_JOB_ID"',
            "fi",
        ]
    return out + ['exit "$spmd_status"']


def render(o: SubmitOptions) -> str:
    """Return the batch file for o; raise SubmitError for a value it cannot hold safely."""
    what = "-m " + o.script if o.module else o.script
    per_node = f" ({o.nodes} nodes x {o.ntasks_per_node})" if o.ntasks_per_node and o.nodes > 1 \
        else f" on {o.nodes} nodes" if o.nodes > 1 else ""
    tasks = _plural(o.ntasks, "task")
    if o.max_nodes:
        tasks, per_node = f"{_plural(o.ntasks_per_node, 'task')} per node", f" on {o.node_range} nodes"
    header = ["#!/bin/bash",
              f"# spmd submit: {_comment(what)}, {tasks}{per_node}, "
              f"{o.launcher}, backend {o.backend}"]
    body = ["", *_environment(o), *_setup(o), *_world_check(o), *_preflight(o), "", *_launch(o)]
    return "\n".join(header + _directives(o) + body) + "\n"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _comment(text: str) -> str:
    """Return text fit for a comment line: control characters shown as escapes."""
    return _CONTROL.sub(lambda m: repr(m[0])[1:-1], text)
