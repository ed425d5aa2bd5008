"""The doctor's command line, `spmd doctor` and `python -m spmd.doctor`: check every host and pair of hosts."""

import os
import sys

import click

from spmd.errors import SpmdError


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (hosts, pairs, collectives, findings).")
@click.option("--timeout", type=click.FloatRange(min=1), default=20.0, show_default=True,
              help="Seconds the ranks wait for each other to start.")
@click.option("--connect-within", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="Seconds a connection between two hosts may take before it counts as failed.")
@click.option("--bandwidth-seconds", type=click.FloatRange(min=0), default=0.2, show_default=True,
              help="Seconds each host sends to each other host for the bandwidth matrix (0: no matrix).")
@click.option("--bandwidth-mb", type=click.FloatRange(min=0), default=64.0, show_default=True,
              help="MB each host sends to each other host at most.")
@click.option("--collectives/--no-collectives", default=True, show_default=True,
              help="Start spmd and run one of every collective once the pairs pass.")
def doctor(as_json, timeout, connect_within, bandwidth_seconds, bandwidth_mb, collectives):
    """Check this job's hosts: names, interfaces, versions and clocks, every pair's connection and
    bandwidth, and one of every collective. Launch it like the job (mpirun, srun, torchrun); rank 0
    reports. Exit status 0 when nothing found would stop a job. docs/doctor.md."""
    from spmd.doctor import Options, diagnose
    from spmd.doctor.report import as_json as json_of
    from spmd.doctor.report import as_text

    options = Options(timeout, connect_within, bandwidth_seconds, int(bandwidth_mb * 1e6), collectives)
    try:
        outcome = diagnose(os.environ, options)
    except SpmdError as exc:
        click.echo(f"spmd doctor: {exc}", err=True)
        sys.exit(1)
    if outcome.note:
        click.echo(outcome.note, err=True)
    if outcome.report is not None:
        click.echo(json_of(outcome.report) if as_json else as_text(outcome.report))
    if outcome.abandoned:  # a silent peer may hold MPI_Finalize: end without it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(outcome.status)
    sys.exit(outcome.status)
