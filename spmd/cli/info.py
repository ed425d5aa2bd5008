"""``spmd info``: what this process would be, and why; under a launcher, what each rank of the job chose."""

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


def rank_row(placement, backend):
    """One rank's row of the job's table: where it runs, the address and interface it chose, and why."""
    return {"rank": placement.rank, "host": placement.host, "node_rank": placement.node_rank,
            "num_nodes": placement.num_nodes, "local_rank": placement.local_rank,
            "local_size": placement.local_size, "address": placement.address, "interface": placement.interface,
            "why": placement.sources.get("address"), "placed": placement.sources.get("node_rank"),
            "backend": backend}


def rank_lines(rows):
    """The job's table as text: how placement was learnt, then a line per rank."""
    placed = list(dict.fromkeys(str(r["placed"]) for r in rows))
    if all(p.startswith("measured: ") for p in placed):
        head = "placement measured from where each rank runs, not rank arithmetic: " + "; ".join(
            p[len("measured: "):] for p in placed)
    else:
        head = "placement: " + "; ".join(placed)
    head = f"ranks ({head}):"
    table = [("rank", "host", "node", "local", "address", "interface", "why")] + [
        (str(r["rank"]), str(r["host"]), f"{r['node_rank']}/{r['num_nodes']}", f"{r['local_rank']}/{r['local_size']}",
         str(r["address"]), str(r["interface"]), str(r["why"])) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(6)]
    return [head] + ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[6] for row in table]


def _job(report):
    """Under a launcher: start spmd (the ranks meet, as a job's would) and gather every rank's row to
    rank 0.  Return this rank's number; on rank 0, report holds the measured placement and the rows."""
    import spmd

    comm = spmd.init()
    rows = comm.gather_object(rank_row(comm.placement, comm.backend), root=0)
    if comm.rank == 0:
        report.update(placement=comm.placement.as_dict(), backend=comm.backend, ranks=rows)
    return comm.rank, comm.placement


def _print(report, placement):
    if placement is not None:
        click.echo(placement.describe())
    click.echo("backends:")
    for name, state in report["backends"].items():
        click.echo(f"  {name:5s} {state}")
    click.echo(f"requested backend: {report['requested_backend']}")
    if "backend" in report:
        click.echo(f"backend: {report['backend']}")
    elif "auto_backend" in report:
        click.echo(f"auto would choose: {report['auto_backend']}")
    click.echo(f"CUDA devices: {report['devices']['cuda']}")
    net = report["network"]
    click.echo(f"host: {net['host']} (its name resolves to {', '.join(net['resolves_to']) or 'nothing'})")
    click.echo(f"addresses: {'; '.join(net['addresses'])}")
    if net["note"]:
        click.echo(f"note: {net['note']}; spmd never publishes it to another host")
    if "ranks" in report:
        for line in rank_lines(report["ranks"]):
            click.echo(line)
    else:
        click.echo(f"network: {net['choice']}")
    if report["error"]:
        click.echo(f"error: {report['error']}", err=True)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for machines.")
def info(as_json):
    """Print this process's placement, where each value came from, the
    available backends and devices, and any conflict found.  Under a
    launcher (mpiexec, srun, torchrun) the ranks meet as a job's would,
    and rank 0 alone prints, for its host, the same, then a row per rank:
    its host, node and local numbers (measured), the address and
    interface it chose, and why."""
    report, placement = gather_info()
    if placement is not None and placement.size > 1 and placement.launcher != "none" and not report["error"]:
        try:
            rank, placement = _job(report)
        except SpmdError as exc:
            if placement.rank == 0 and not getattr(exc, "everywhere", False):  # said once already if so
                click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        if rank != 0:
            sys.exit(0)
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True))
    else:
        _print(report, placement)
    sys.exit(1 if report["error"] else 0)
