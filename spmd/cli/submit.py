"""``spmd submit``: write a SLURM batch file for a script, check it, submit it."""

import os
import re
import shlex
import sys
import time
from pathlib import Path

import click

from spmd.util.atomic import atomic_write
from spmd.submit import profiles
from spmd.submit import sbatch as slurm
from spmd.submit.batch import render
from spmd.submit.options import BACKENDS, DEFAULT_OUTPUT, LAUNCHERS, SubmitError, check, make

__all__ = ["submit"]

_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]+")


def _opt(*names, **kw):
    return click.option(*names, default=kw.pop("default", None), **kw)


@click.command(context_settings={"allow_interspersed_args": False,
                                 "help_option_names": ["-h", "--help"]})
@_opt("-N", "--nodes", metavar="N|MIN-MAX",
      help="Number of nodes, or a range: SLURM gives MIN to MAX (a requeued job starts on the nodes left).")
@_opt("--ntasks-per-node", type=int, help="Tasks (ranks) per node.")
@_opt("-n", "--ntasks", type=int, help="Total tasks (ranks): the world size.")
@_opt("-c", "--cpus-per-task", type=int, help="CPUs per task.")
@_opt("--gpus-per-node", metavar="[TYPE:]N", help="GPUs per node.")
@_opt("--gres", help="Generic resources (not with --gpus-per-node for GPUs).")
@_opt("--mem", help="Memory per node, e.g. 16G.")
@_opt("--mem-per-cpu", help="Memory per CPU, e.g. 2000M.")
@_opt("-t", "--time", help="Time limit: MIN, H:M:S, D-H[:M[:S]].")
@_opt("-p", "--partition")
@_opt("-A", "--account")
@_opt("-q", "--qos")
@_opt("-J", "--job-name", help="[default: the script's name]")
@_opt("-o", "--output", help=f"Log file, SLURM's patterns [default: {DEFAULT_OUTPUT}].")
@_opt("-e", "--error", help="Separate stderr file [default: with the output].")
@_opt("-C", "--constraint", help="Node features.")
@_opt("--exclusive/--no-exclusive", help="Whole nodes.")
@_opt("-a", "--array", help="Job array indexes, e.g. 0-15%4.")
@_opt("-d", "--dependency", help="e.g. afterok:123.")
@_opt("--mail-type", help="e.g. END,FAIL.")
@_opt("--mail-user")
@click.option("--sbatch-option", "sbatch_options", multiple=True, metavar="--OPT[=VALUE]",
              help="Any other sbatch option (repeatable).")
@click.option("--env", multiple=True, metavar="NAME=VALUE",
              help="Export to every task (repeatable).")
@click.option("--setup", multiple=True, metavar="LINE",
              help="Shell line run before the launch, e.g. 'module load x' (repeatable).")
@_opt("--backend", type=click.Choice(BACKENDS), help="[default: auto]")
@_opt("--launcher", type=click.Choice(LAUNCHERS),
      help="srun (default; --mpi=pmi2 for the mpi backend) or mpirun.")
@_opt("--mpi", metavar="TYPE", help="srun --mpi type [default: pmi2 for backend mpi].")
@_opt("--python", metavar="PATH", help="Python in the job [default: this one].")
@_opt("--mpirun", metavar="PATH", help="mpirun for --launcher mpirun.")
@_opt("-m", "module", is_flag=True, help="SCRIPT is a module, run like python -m.")
@_opt("-D", "--chdir", metavar="DIR", help="Job's working directory [default: here].")
@_opt("--requeue/--no-requeue", help="Requeue after the preemption signal.")
@_opt("--signal-before", type=int, metavar="SECONDS",
      help="Signal the job this long before its time limit (spmd.preempt).")
@_opt("--preempt-signal", metavar="SIG", help="[default: USR1]")
@_opt("--profile", metavar="NAME", help="Profile from submit.toml / spmd-submit.toml.")
@click.option("--save-dir", default="logs/submit", show_default=True, metavar="DIR",
              help="Where batch files and records go.")
@click.option("--dry-run", is_flag=True, help="Print the file and the sbatch command only.")
@click.option("--preflight/--no-preflight", default=None,
              help="--preflight: the job's first step runs spmd doctor on every node and ends the job with its "
                   "table when a pair of nodes fails; --no-preflight: not even sbatch --test-only.")
@click.option("--test-only/--no-test-only", "test_only", default=None,
              help="Check the file with sbatch --test-only before submitting. [default: on, off with --no-preflight]")
@click.option("--wait", is_flag=True, help="Wait for the end; exit with the job's code.")
@click.option("--tail", "tail_lines", default=20, show_default=True, metavar="LINES",
              help="Log lines shown by --wait.")
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def submit(profile, save_dir, dry_run, preflight, test_only, wait, tail_lines, **given):
    """Write a batch file that runs SCRIPT ARGS on a SLURM allocation, and submit it.

    \b
        spmd submit -N 4 --ntasks-per-node 2 -t 30 jobs/scatter_gather.py --rows 1000
        spmd submit --dry-run --profile gpu -N 2 jobs/train_dp.py

    The job runs `srun python -m spmd SCRIPT ARGS` (job-wide abort when a rank
    fails). Options come from the profile, overridden by the command line.
    The job id is printed on stdout; a record (command, file hash, job id)
    is saved beside the batch file.
    """
    if preflight is True:
        given["preflight"] = True
    test_only = preflight is not False if test_only is None else test_only
    try:
        options = _options(profile, given)
    except SubmitError as exc:
        raise click.ClickException(str(exc)) from None
    for note in options.notes:
        slurm.say(f"note: {note}")
    for var in slurm.sbatch_variables():
        slurm.say(f"warning: {var} is set and overrides the batch file's directives "
                  "(the job checks that it still gets the world it asks for)")
    try:
        text = render(options)
        path = _batch_path(Path(save_dir), options.name)
        if dry_run:
            click.echo(text, nl=False)
            click.echo(f"# sbatch command: {shlex.join(['sbatch', '--parsable', str(path)])}")
            return
        code = _submit(options, text, path, test_only, wait, tail_lines)
    except SubmitError as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(code)


def _options(profile, given):
    layer, sources = profiles.load(profile)
    for source in sources:
        slurm.say(f"profile: {source}")
    cli = {k: v for k, v in given.items() if v not in (None, ())}
    cli["args"] = given["args"]
    if "env" in cli:
        cli["env"] = check("env", cli["env"])
    merged = profiles.merge(_defaults(given, layer), layer, cli)
    merged["chdir"] = os.path.abspath(os.path.expanduser(merged["chdir"]))
    if not merged.get("module") and not os.path.exists(
            os.path.join(merged["chdir"], merged["script"])):
        raise SubmitError(f"no such file: {merged['script']!r} (in {merged.get('chdir')})")
    return make(merged)


def _defaults(given, layer):
    python = given.get("python") or layer.get("python") or sys.executable
    mpirun = Path(python).parent / "mpirun"
    return {"python": python, "chdir": os.getcwd(),
            "mpirun": str(mpirun) if mpirun.exists() else "mpirun"}


def _batch_path(folder, name):
    stem = _SAFE_NAME.sub("_", name)[:60] or "job"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = folder / f"{stem}-{stamp}.sbatch", 1
    while path.exists():
        path, n = folder / f"{stem}-{stamp}-{n}.sbatch", n + 1
    return path


def _output_dirs(options):
    """Create the log directories SLURM will write to (it does not create them)."""
    for pattern in filter(None, (options.output, options.error)):
        folder = os.path.dirname(pattern)
        if folder and "%" not in folder:
            os.makedirs(os.path.join(options.chdir or "", folder), exist_ok=True)
        elif folder:
            slurm.say(f"note: cannot create {folder!r} ahead (it has a % pattern); "
                      "it must exist when the job starts")


def _submit(options, text, path, test_only, wait, tail_lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path, text=True, exclusive=True) as f:  # never a half batch file, never over one
        f.write(text)
    _output_dirs(options)
    if test_only and slurm.have_sbatch():
        ok, verdict = slurm.test_only(path)
        slurm.say(f"sbatch --test-only: {verdict}")
        if not ok:
            raise SubmitError(f"sbatch --test-only rejects {path}; not submitted "
                              "(--no-test-only skips this check)")
    job_id, cluster, command = slurm.submit(path)
    record = slurm.write_record(path, command, job_id, cluster, _submit_command())
    click.echo(job_id)
    slurm.say(f"submitted job {job_id}{' on ' + cluster if cluster else ''}: {path} "
              f"(record {record})")
    if not wait:
        return 0
    records = slurm.wait(job_id, on_change=lambda rs: slurm.say(
        "job " + ", ".join(f"{r.job_id} {r.state}" for r in rs)))
    for r in records:
        log = r.stdout or slurm.expand_pattern(
            os.path.join(options.chdir or "", options.output), r.job_id, options.name)
        slurm.say(f"job {r.job_id} {r.state}, exit code {r.exit_code}:{r.signal}; log {log}")
        if log and tail_lines > 0:
            click.echo(slurm.tail(log, tail_lines))
    return slurm.exit_status(records)


def _submit_command():
    """The command line as the user typed it, for the record."""
    args = sys.argv[1:]
    if args[:1] == ["submit"]:  # the spmd console script; bin/submit passes the options only
        args = args[1:]
    return ["spmd", "submit", *args]

