"""``spmd info``: what this process would be, and why."""

import json
import os
import sys

import click

from spmd.runtime import backends
from spmd.errors import SpmdError
from spmd.config.placement import detect


def _devices():
    if "torch" not in sys.modules and not os.path.exists("/dev/nvidiactl"):
        return {"cuda": 0, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    import torch

    return {
        "cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def _auto_choice(placement, available):
    """Say what auto would pick, without starting MPI or torch.distributed."""
    if placement.size == 1:
        return "serial"
    if placement.launcher != "none" and available.get("nccl") is None:
        return "nccl"
    if placement.is_mpi and available.get("mpi") is None:
        return "mpi (if mpi4py's world agrees with the launcher)"
    return "gloo"


def gather_info(environ=None):
    """Return everything spmd info reports, as a JSON-able dict."""
    environ = os.environ if environ is None else environ
    report = {"placement": None, "error": None}
    try:
        placement = detect(environ)
        report["placement"] = placement.as_dict()
    except SpmdError as exc:
        placement, report["error"] = None, str(exc)
    available = backends.available_backends()
    report["backends"] = {name: reason or "available" for name, reason in available.items()}
    try:
        report["requested_backend"] = backends.requested_backend(None, environ)
    except SpmdError as exc:
        report["requested_backend"], report["error"] = None, str(exc)
    if placement is not None:
        report["auto_backend"] = _auto_choice(placement, available)
    report["devices"] = _devices()
    return report, placement


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for machines.")
def info(as_json):
    """Print this process's placement, where each value came from, the
    available backends and devices, and any conflict found."""
    report, placement = gather_info()
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True))
    else:
        if placement is not None:
            click.echo(placement.describe())
        click.echo("backends:")
        for name, state in report["backends"].items():
            click.echo(f"  {name:5s} {state}")
        click.echo(f"requested backend: {report['requested_backend']}")
        if "auto_backend" in report:
            click.echo(f"auto would choose: {report['auto_backend']}")
        click.echo(f"CUDA devices: {report['devices']['cuda']}")
        if report["error"]:
            click.echo(f"error: {report['error']}", err=True)
    sys.exit(1 if report["error"] else 0)
