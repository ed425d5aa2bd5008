"""``spmd bench``: time every collective against raw mpi4py and raw gloo.

Run it under a launcher (``mpirun -n 2 spmd bench``), or let it start
``mpirun -n N`` itself with ``--launch N``.  ``--startup`` instead
launches small jobs one after another and reports where start-up time
goes.
"""

import os
import subprocess
import sys
import time
import traceback

import click

from spmd.bench.cases import ALL, COLLECTIVES, EXTRAS, MESSAGES
from spmd.errors import SpmdError
from spmd.util.paths import BENCH

__all__ = ["bench"]

CHOICES = ALL


def _names(value, allowed, what):
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise click.BadParameter(f"unknown {what} {', '.join(bad) or '(none)'}; choose from {', '.join(allowed)}")
    return names


def _settings(opts):
    from spmd.bench import IMPLS, Settings, default_sizes, parse_size

    try:
        if opts["sizes"]:
            sizes = tuple(sorted({parse_size(s) for s in opts["sizes"].split(",") if s.strip()}))
        else:
            sizes = default_sizes(parse_size(opts["min_size"]), parse_size(opts["max_size"]), opts["factor"])
        count, _, each = opts["many"].lower().partition("x")
        many = (int(count), parse_size(each))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    impls = opts["impls"]
    return Settings(
        collectives=_names(opts["collectives"], CHOICES, "collective"),
        sizes=sizes,
        impls=_names(impls, IMPLS + ("mpi4py-torchbuf",), "implementation") if impls else None,
        rounds=opts["rounds"],
        target=opts["target"],
        many=many,
        verify=opts["verify"],
    )


def _relaunch(ctx, ranks):
    """Run this same command under mpirun -n ranks and return its exit code."""
    from spmd.bench.startup import find_mpirun

    mpirun = find_mpirun()
    if mpirun is None:
        raise click.ClickException("--launch needs mpirun: pip install mpich, or start spmd bench under your launcher")
    args = []
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        given = ctx.get_parameter_source(param.name) == click.core.ParameterSource.COMMANDLINE
        if param.name == "launch" or not given:
            continue
        if param.is_flag:
            args.append(param.opts[0] if value else param.secondary_opts[0])
        else:
            args += [param.opts[0], str(value)]
    cmd = [mpirun, "-n", str(ranks), sys.executable, "-m", BENCH] + args
    click.echo("running: " + " ".join(cmd), err=True)
    return subprocess.call(cmd)


_POSITIVE = click.FloatRange(min=0, min_open=True)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--launch", type=click.IntRange(min=2), metavar="N",
              help="Start mpirun -n N of this command yourself (else run under a launcher).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help="Write rows, summary and metadata here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Write a PNG of busbw against size (needs matplotlib).")
@click.option("--collectives", default=",".join(COLLECTIVES + EXTRAS), show_default=True,
              help=f"Comma-separated list; also {', '.join(MESSAGES)} (point to point and the later collectives).")
@click.option("--impls", help="Comma-separated subset of spmd-mpi, mpi4py, spmd-gloo, gloo (also "
              "mpi4py-torchbuf: raw mpi4py on torch-allocated memory) [default: all available].")
@click.option("--backends", help="mpi,gloo: the worlds to start [default: mpi,gloo under MPI, else gloo].")
@click.option("--sizes", help="Exact sizes, comma-separated: 8,1K,1M (binary units).")
@click.option("--min-size", default="8", show_default=True, help="Smallest size of the sweep.")
@click.option("--max-size", default="256M", show_default=True, help="Largest size of the sweep.")
@click.option("--factor", default=4, show_default=True, type=click.IntRange(min=2), help="Step of the sweep.")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(min=1),
              help="Rounds; each implementation takes a turn per size per round.")
@click.option("--target-time", "target", default=0.1, show_default=True, type=_POSITIVE,
              help="Seconds of samples per implementation, size and round.")
@click.option("--many", default="200x4K", show_default=True, help="all_reduce_many: COUNTxBYTES tensors.")
@click.option("--threads", type=click.IntRange(min=1),
              help="torch threads per rank [default: cores / ranks per node].")
@click.option("--spread", is_flag=True, help="Show p10-p90 in the table.")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Check each implementation's result first.")
@click.option("--quiet", is_flag=True, help="No progress lines.")
@click.option("--alone", is_flag=True, help="Run in a world of one, without a launcher (MPI.COMM_SELF and "
              "a one-rank gloo group): spmd minus raw is then each wrapper's own cost per call.")
@click.option("--cpu-clock", is_flag=True, help="With --alone: time with this process's CPU clock "
              "(all its threads), which other jobs on the machine barely disturb.")
@click.option("--startup", is_flag=True,
              help="Measure start-up instead: separate mpirun launches (not under a launcher).")
@click.option("--startup-ranks", default=8, show_default=True, type=click.IntRange(min=1),
              help="Ranks of each start-up launch.")
@click.option("--repeats", type=click.IntRange(min=1),
              help="Start-up launches per scenario [default: 5]; --pipeline: launches per case [default: 3]; "
                   "--pytest: runs per way [default: 3].")
@click.option("--script", type=click.Path(exists=True, dir_okay=False),
              help="Start-up: time to the first collective of this script "
                   "[default: jobs/scatter_gather.py, else jobs/collectives.py, if present].")
@click.option("--preload", "preload_modules", metavar="MODULES",
              help="Measure spmd run --preload MODULES instead (e.g. torch): the job's first collective and "
                   "wall against an empty script, spmd run without preload and mpirun (--startup-ranks, "
                   "--repeats, --script).")
@click.option("--train", is_flag=True,
              help="Measure training instead: spmd's DataParallel on gloo and mpi (plain, overlap, bf16) beside "
                   "torch's DistributedDataParallel, separate launches (spmd.bench.train; --pipeline-ranks "
                   "for the rank counts, default 1,2,4 here; --repeats, default 5; --vocab).")
@click.option("--vocab", type=click.IntRange(min=2),
              help="--train: the model's vocabulary [default: jobs/train_dp.py's, 32; BERT's is 30522]. The "
                   "embedding's gradient as rows beside DDP: python -m spmd.bench.rows.")
@click.option("--pytest", "pytest_bench", is_flag=True,
              help="Measure spmd's pytest plugin instead: --tests tests of --test-ranks ranks under plain pytest "
                   "and mpirun, beside pytest_parallel, one mpirun per test and torch's MultiProcessTestCase "
                   "(spmd.bench.pytest_plugin; --repeats, default 3).")
@click.option("--tests", default=200, show_default=True, type=click.IntRange(min=1), help="--pytest: tests.")
@click.option("--test-ranks", default=4, show_default=True, type=click.IntRange(min=1), help="--pytest: ranks each.")
@click.option("--per-test-sample", default=10, show_default=True, type=click.IntRange(min=1),
              help="--pytest: tests the per-test ways time, scaled to --tests.")
@click.option("--tools-path", help="--pytest: directories on PYTHONPATH for pytest_parallel and torch's ways.")
@click.option("--pipeline", is_flag=True,
              help="Measure spmd.pipeline instead, against an mpi4py loop, Pool.imap and MPIPoolExecutor "
                   "(separate launches, not under a launcher).")
@click.option("--pipeline-ranks", default="1,2,4,8", show_default=True, help="--pipeline: rank counts.")
@click.option("--scenarios", default="table", show_default=True,
              help="--pipeline: comma-separated table (every case at every rank count), busy (balance even "
                   "against speed beside a busy process), memory (root's peak at --memory-rows).")
@click.option("--busy-procs", default=1, show_default=True, type=click.IntRange(min=1),
              help="--pipeline busy scenario: spinning processes on rank 1's core.")
@click.option("--rows", "pipeline_rows", default=1_000_000, show_default=True, type=click.IntRange(min=1),
              help="--pipeline: input rows.")
@click.option("--memory-rows", default="1000000,10000000", show_default=True,
              help="--pipeline memory scenario: input sizes.")
@click.option("--memory", is_flag=True,
              help="Measure memory instead: the extra peak memory of one all_reduce of the largest "
                   "size (--max-size or --sizes), whole and with chunk_bytes=--chunk.")
@click.option("--chunk", default="1M", show_default=True, help="--memory: the chunk_bytes to compare.")
@click.pass_context
def bench(ctx, **opts):
    """Time the six collectives (and uneven chunks, and a list of small
    tensors) on spmd's mpi and gloo backends against raw mpi4py and raw
    torch.distributed gloo, in the same processes, interleaved in rounds.

    Prints a table on rank 0 (median time per call and busbw), and
    writes JSON and a plot when asked.  Example:

        mpirun -n 2 spmd bench --max-size 64M --json out.json --plot out.png
    """
    if opts["memory"] and (opts["startup"] or opts["alone"]):
        raise click.UsageError("--memory runs in a launched world: leave out --startup and --alone")
    separate = (opts["startup"], opts["pipeline"], opts["preload_modules"], opts["train"], opts["pytest_bench"])
    if sum(map(bool, separate)) > 1:
        raise click.UsageError("--startup, --pipeline, --preload, --train and --pytest are separate benchmarks: "
                               "choose one")
    if opts["pytest_bench"]:
        _pytest(opts)
        return
    if opts["train"]:
        _train(opts)
        return
    if opts["preload_modules"]:
        _preload(opts)
        return
    if opts["startup"]:
        _startup(opts["startup_ranks"], opts["repeats"] or 5, opts["script"], opts["json_path"], opts["quiet"])
        return
    if opts["pipeline"]:
        _pipeline(opts)
        return
    settings = _settings(opts)
    if opts["cpu_clock"] and not opts["alone"]:
        raise click.UsageError("--cpu-clock needs --alone: with peers, waiting for them takes no CPU")
    settings.clock = "cpu" if opts["cpu_clock"] else "wall"
    if opts["launch"]:
        if opts["alone"]:
            raise click.UsageError("--alone runs in this process; leave out --launch")
        sys.exit(_relaunch(ctx, opts["launch"]))
    _in_world(settings, opts)


def _in_world(settings, opts):
    from spmd.bench import open_alone, open_world, run
    from spmd.bench.report import document, meta, plot, summary, summary_table, table, write_json
    from spmd.config.placement import detect

    started, load, thp = time.time(), list(os.getloadavg()), os.environ.get("THP_MEM_ALLOC_ENABLE")
    alone = opts["alone"]
    if opts["backends"]:
        wanted = _names(opts["backends"], ("mpi", "gloo"), "backend")
    else:
        wanted = ("mpi", "gloo") if alone or detect(os.environ).is_mpi else ("gloo",)
    try:
        world = (open_alone if alone else open_world)(wanted, opts["threads"])
    except SpmdError as exc:
        raise click.ClickException(str(exc)) from None
    lead = world.rank == 0
    if opts["memory"]:
        _memory(world, settings, opts)
        return

    def progress(row):
        click.echo(f"  {row['collective']:<16}{row['impl']:<20}{row['size']:>11} B "
                   f"{row['time_us']:>12.1f} us", err=True)

    try:
        rows = run(world, settings, None if opts["quiet"] or not lead else progress)
        info = meta(world, settings, started, load_start=load, thp_env_start=thp)
    except BaseException:
        if world.size > 1 and world.mpi is not None:  # peers may wait forever: end the job
            from spmd.runtime.start import abort_job

            traceback.print_exc()
            abort_job(1)  # as a failing rank of any spmd job: flush, a moment, MPI_Abort
        raise
    world.close()
    if not lead:
        return
    click.echo(table(rows, opts["spread"]))
    click.echo(summary_table(summary(rows)))
    if opts["json_path"]:
        write_json(opts["json_path"], document(rows, info))
        click.echo(f"wrote {opts['json_path']}", err=True)
    if opts["plot_path"]:
        try:
            plot(rows, opts["plot_path"], f"spmd bench, {world.size} ranks on {info['hosts'][0]}")
        except RuntimeError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"wrote {opts['plot_path']}", err=True)


def _memory(world, settings, opts):
    from spmd.bench import memory, parse_size
    from spmd.bench.report import write_json

    if not memory.available():
        raise click.ClickException("--memory needs Linux's /proc/self/clear_refs and VmHWM")
    nbytes = settings.sizes[-1] if settings.sizes else 64 << 20
    rows = memory.measure(world, nbytes, parse_size(opts["chunk"]))
    world.close()
    if world.rank != 0:
        return
    click.echo(memory.memory_table(rows))
    if opts["json_path"]:
        write_json(opts["json_path"], {"schema": "spmd-bench-memory/1", "rows": rows})
        click.echo(f"wrote {opts['json_path']}", err=True)


def _pipeline(opts):
    from spmd.bench import pipeline as pb
    from spmd.bench.report import write_json

    scenarios = _names(opts["scenarios"], ("table", "busy", "memory"), "scenario")
    try:
        ranks = tuple(int(n) for n in opts["pipeline_ranks"].split(",") if n.strip())
        sizes = tuple(int(float(n)) for n in opts["memory_rows"].split(",") if n.strip())
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    progress = None if opts["quiet"] else (lambda line: click.echo(line, err=True))
    repeats, rows = opts["repeats"] or 3, opts["pipeline_rows"]
    doc = {"schema": "spmd-bench-pipeline/1", "load_average_start": list(os.getloadavg()), "rows": rows,
           "chunk_rows": pb.CHUNK}
    try:
        if "table" in scenarios:
            doc["table"] = pb.measure(ranks, repeats, rows, progress=progress)
            click.echo(pb.table(doc["table"]))
            if opts["plot_path"]:
                pb.plot(doc["table"], opts["plot_path"], f"spmd bench --pipeline: {rows:,} rows, mlp, "
                        f"{os.cpu_count()} cores")
                click.echo(f"wrote {opts['plot_path']}", err=True)
        if "busy" in scenarios:
            doc["busy"] = pb.busy(repeats, rows, progress=progress, spinners=opts["busy_procs"])
            click.echo(pb.busy_table(doc["busy"]))
        if "memory" in scenarios:
            doc["memory"] = pb.memory(sizes, progress=progress)
            click.echo(pb.memory_table(doc["memory"]))
    except (SpmdError, subprocess.TimeoutExpired) as exc:
        raise click.ClickException(str(exc)) from None
    doc["load_average_end"] = list(os.getloadavg())
    if opts["json_path"]:
        write_json(opts["json_path"], doc)
        click.echo(f"wrote {opts['json_path']}", err=True)


def _train(opts):
    from spmd.bench import train

    given = click.get_current_context().get_parameter_source("pipeline_ranks")
    text = opts["pipeline_ranks"] if given == click.core.ParameterSource.COMMANDLINE else "1,2,4"
    try:
        ranks = tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    progress = None if opts["quiet"] else (lambda line: click.echo(line, err=True))
    try:
        model = {"vocab": opts["vocab"]} if opts["vocab"] else None
        doc = train.bench(ranks, opts["repeats"] or 5, model=model, progress=progress)
    except (SpmdError, subprocess.TimeoutExpired) as exc:
        raise click.ClickException(str(exc)) from None
    _show(train.report(doc), doc, opts)


def _show(text, doc, opts):
    """Print a benchmark's report; write its document as JSON where asked."""
    from spmd.bench.report import write_json

    click.echo(text)
    if opts["json_path"]:
        write_json(opts["json_path"], doc)
        click.echo(f"wrote {opts['json_path']}", err=True)


def _pytest(opts):
    from spmd.bench import pytest_plugin

    progress = None if opts["quiet"] else (lambda line: click.echo(line, err=True))
    try:
        doc = pytest_plugin.bench(opts["tests"], opts["test_ranks"], opts["repeats"] or 3, opts["per_test_sample"],
                                  tools_path=opts["tools_path"], progress=progress)
    except (SpmdError, subprocess.TimeoutExpired) as exc:
        raise click.ClickException(str(exc)) from None
    _show(pytest_plugin.report(doc), doc, opts)


def _preload(opts):
    from spmd.bench import preload
    from spmd.bench.report import write_json

    log = None if opts["quiet"] else (lambda line: click.echo(line, err=True))
    modules = [m.strip() for m in opts["preload_modules"].split(",") if m.strip()]
    try:
        results = preload.measure(opts["startup_ranks"], opts["repeats"] or 3, opts["script"], (), modules, log=log)
    except (SpmdError, subprocess.TimeoutExpired) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(preload.report(results, opts["startup_ranks"]))
    if opts["json_path"]:
        write_json(opts["json_path"], {"schema": "spmd-bench-preload/1", "modules": modules, "results": results})
        click.echo(f"wrote {opts['json_path']}", err=True)


def _startup(ranks, repeats, script, json_path, quiet):
    from spmd.bench.report import write_json
    from spmd.bench.startup import measure, startup_table

    if script is None:
        for candidate in ("jobs/scatter_gather.py", "jobs/collectives.py"):
            if os.path.exists(candidate):
                script = candidate
                break
    progress = None if quiet else (lambda line: click.echo(line, err=True))
    try:
        rows = measure(ranks, repeats, script and os.path.abspath(script), progress=progress)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(startup_table(rows))
    if json_path:
        write_json(json_path, {"schema": "spmd-bench-startup/1", "load_average": list(os.getloadavg()),
                               "startup": rows})
        click.echo(f"wrote {json_path}", err=True)


if __name__ == "__main__":
    bench(prog_name="spmd bench")
