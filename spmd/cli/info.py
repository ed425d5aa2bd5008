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
    report["network"] = _network(placement, environ)
    return report, placement


def _network(placement, environ):
    """This host's name, what it resolves to, its addresses, and the interface spmd would use."""
    from spmd.runtime import network

    card = network.local_card()
    out = {"host": card.name, "resolves_to": list(card.resolves_to),
           "addresses": [f"{a.interface} {a.ip}/{a.prefix}" for a in card.addresses],
           "note": network.loopback_name_note(card)}
    toward = placement.master_addr if placement is not None else None
    try:
        if network.user_interface(environ) is not None or placement is None or placement.size == 1:
            choice = network.choose_toward(card, "127.0.0.1", None, environ, same_host=True)
        elif toward:
            target = network.resolved(toward) or toward
            choice = network.choose_toward(card, target, network.route_source(target), environ)
        else:
            choice = None
            out["choice"] = ("chosen at init from every rank's host, over MPI or the rendezvous store: an address "
                             "on the network every other host shares (comm.placement.address)")
    except SpmdError as exc:
        choice, out["choice"] = None, f"error: {exc}"
    if choice is not None:
        out["choice"] = f"{choice.interface} {choice.address}: {choice.why}"
    return out


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
        net = report["network"]
        click.echo(f"host: {net['host']} (its name resolves to {', '.join(net['resolves_to']) or 'nothing'})")
        click.echo(f"addresses: {'; '.join(net['addresses'])}")
        if net["note"]:
            click.echo(f"note: {net['note']}; spmd never publishes it to another host")
        click.echo(f"network: {net['choice']}")
        if report["error"]:
            click.echo(f"error: {report['error']}", err=True)
    sys.exit(1 if report["error"] else 0)
