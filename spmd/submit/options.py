"""What a submission asks for: one frozen SubmitOptions, built and checked by ``make``.

``make(values)`` takes a mapping of option names (``ntasks_per_node`` or
``ntasks-per-node``) to values, as merged from profiles and the command line,
and returns a validated SubmitOptions or raises SubmitError naming the option,
the value and the accepted forms. Counts are resolved here: the world size and,
when it is even, the tasks per node (``layout``).  A node range (``nodes="2-3"``)
sets ``max_nodes``: SLURM then gives any count of nodes in the range, and the world
is that count times ``ntasks_per_node`` (so a requeued job can start on the nodes
left after one failed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from typing import Mapping

from spmd.runtime.backends import BACKENDS
from spmd.errors import SubmitError

__all__ = ["SubmitOptions", "SubmitError", "make", "check", "time_seconds", "OPTION_NAMES",
           "BACKENDS", "LAUNCHERS", "MAIL_TYPES"]

LAUNCHERS = ("srun", "mpirun")
MAIL_TYPES = ("NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT",
              "TIME_LIMIT", "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS")
DEFAULT_OUTPUT = "logs/%x-%j.out"
MAX_SIGNAL_SECONDS = 65535  # sbatch's --signal=...@TIME is a 16-bit count of seconds


@dataclass(frozen=True)
class SubmitOptions:
    """Everything the batch file is made from; build with ``make``."""

    script: str
    args: tuple[str, ...] = ()
    module: bool = False
    python: str = "python3"
    # resources
    nodes: int | None = None  # the node count, or the least of a range
    max_nodes: int | None = None  # the most of a node range (--nodes MIN-MAX), else None
    ntasks: int | None = None
    ntasks_per_node: int | None = None
    cpus_per_task: int | None = None
    gpus_per_node: str | None = None
    gres: str | None = None
    mem: str | None = None
    mem_per_cpu: str | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    # bookkeeping
    job_name: str | None = None
    output: str = DEFAULT_OUTPUT
    error: str | None = None
    chdir: str | None = None
    array: str | None = None
    dependency: str | None = None
    mail_type: str | None = None
    mail_user: str | None = None
    sbatch_options: tuple[str, ...] = ()
    # what runs
    env: tuple[tuple[str, str], ...] = ()
    setup: tuple[str, ...] = ()
    backend: str = "auto"
    launcher: str = "srun"
    mpi: str | None = None
    mpirun: str = "mpirun"
    preflight: bool = False  # the first step runs spmd doctor on every node
    # preemption
    requeue: bool = False
    signal_before: int | None = None
    preempt_signal: str = "USR1"
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def world(self) -> int:
        """Return the number of tasks (ranks) of the job: with a node range, the least."""
        return self.ntasks

    @property
    def node_range(self) -> str:
        """Return the node count as sbatch's --nodes takes it: '3', or 'MIN-MAX' for a range."""
        return f"{self.nodes}-{self.max_nodes}" if self.max_nodes else str(self.nodes)

    @property
    def srun_mpi(self) -> str | None:
        """Return srun's --mpi type: the option, else pmi2 for the mpi backend, else None."""
        return self.mpi or ("pmi2" if self.backend == "mpi" else None)

    @property
    def name(self) -> str:
        """Return the job name: the option, else the script's (or module's) base name."""
        if self.job_name:
            return self.job_name
        base = self.script.rsplit("/", 1)[-1]
        return base.rsplit(".", 1)[0] if not self.module and base.endswith(".py") else base


OPTION_NAMES = tuple(f.name for f in fields(SubmitOptions) if f.name != "notes")

_TIME = re.compile(r"(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                   r"|(?P<h>\d+):(?P<m>\d+):(?P<s>\d+)|(?P<mm>\d+):(?P<ss>\d+)|(?P<min>\d+))")
_MEM = re.compile(r"(\d+)([KMGT]?)", re.IGNORECASE)
_ARRAY = re.compile(r"\d+(-\d+(:\d+)?)?(,\d+(-\d+(:\d+)?)?)*(%\d+)?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_WORD = re.compile(r"[A-Za-z0-9_.:+-]+")
_SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP", "URG", "ALRM", "CONT", "QUIT", "XCPU", "PWR")


def _fail(option, value, why):
    raise SubmitError(f"--{option.replace('_', '-')}={value!r}: {why}")


def time_seconds(text: str) -> int | None:
    """Return a SLURM time limit in seconds (None for UNLIMITED), or raise SubmitError."""
    value = text.strip()
    if value.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME.fullmatch(value)
    forms = ("MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, "
             "DAYS-HOURS:MINUTES or DAYS-HOURS:MINUTES:SECONDS (or UNLIMITED)")
    if not m:
        _fail("time", text, f"not a SLURM time; use {forms}, e.g. 90, 1:30:00 or 2-00:00:00")
    g = {k: int(v) for k, v in m.groupdict().items() if v is not None}
    if "d" in g:
        parts = [("hours", g["dh"], 24), ("minutes", g.get("dm", 0), 60), ("seconds", g.get("ds", 0), 60)]
        total = ((g["d"] * 24 + g["dh"]) * 60 + g.get("dm", 0)) * 60 + g.get("ds", 0)
    elif "h" in g:
        parts = [("minutes", g["m"], 60), ("seconds", g["s"], 60)]
        total = (g["h"] * 60 + g["m"]) * 60 + g["s"]
    elif "mm" in g:
        parts = [("seconds", g["ss"], 60)]
        total = g["mm"] * 60 + g["ss"]
    else:
        parts, total = [], g["min"] * 60
    for unit, number, limit in parts:
        if number >= limit:
            _fail("time", text, f"{number} {unit} is out of range (below {limit}); use {forms}")
    return total


def _time(option, value):
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        _fail(option, value, "must be a SLURM time such as 90 or 1:30:00")
    time_seconds(str(value))
    return str(value).strip()


def _memory(option, text):
    m = _MEM.fullmatch(str(text).strip())
    if not m:
        _fail(option, text, "not a memory size; use a number with an optional unit K, M, G "
                            "or T (default M), e.g. 4000, 16G")
    return f"{int(m[1])}{m[2].upper()}"


def _count(option, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, (int, str)) or \
            not re.fullmatch(r"\s*\d+\s*", str(value)) or int(value) < minimum:
        _fail(option, value, f"must be a whole number, at least {minimum}")
    return int(value)


def _nodes(option, value):
    """Return a node count, or (least, most) for a range 'MIN-MAX'."""
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", value) if isinstance(value, str) else None
    if not m:
        return _count(option, value)
    least, most = int(m[1]), int(m[2])
    if least < 1 or most < least:
        _fail(option, value, "a node range is MIN-MAX with 1 <= MIN <= MAX, e.g. 2-4")
    return (least, most) if most > least else least


def _flag(option, value):
    if not isinstance(value, bool):
        _fail(option, value, "must be true or false")
    return value


def _text(option, value):
    if not isinstance(value, str) or not value.strip():
        _fail(option, value, "must be a non-empty string")
    return value


def _lines(option, value):
    value = _strings(option, value)
    for line in value:
        if "\n" in line or "\r" in line:
            _fail(option, line, "holds several lines: give one --setup per line")
    return value


def _pairs(value):
    """Return env as (name, value) pairs from a mapping, pairs or NAME=VALUE strings."""
    if isinstance(value, str):
        value = [value]
    items = value.items() if isinstance(value, Mapping) else \
        [tuple(s) if isinstance(s, (tuple, list)) and len(s) == 2 else
         tuple(s.split("=", 1)) if isinstance(s, str) and "=" in s else (s, None) for s in value]
    out = {}
    for name, val in items:
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            _fail("env", name, "an environment variable name is letters, digits and _, "
                               "not starting with a digit")
        if val is None:
            _fail("env", name, "give NAME=VALUE (the submitting environment is exported to the "
                               "job anyway)")
        out[name] = str(val)
    return tuple(out.items())


def _strings(option, value):
    if isinstance(value, str):
        value = [value]
    if not all(isinstance(v, str) for v in value):
        _fail(option, value, "must be a list of strings")
    return tuple(value)


def _layout(nodes, ntasks, per_node, max_nodes=None):
    """Resolve (nodes, ntasks, ntasks_per_node); ntasks_per_node is None when uneven.  With a
    node range, ntasks is the least world (nodes x ntasks_per_node)."""
    if max_nodes is not None:
        if ntasks is not None:
            raise SubmitError(f"--nodes={nodes}-{max_nodes} with --ntasks={ntasks}: with a node range "
                              "the world is the nodes SLURM gives times --ntasks-per-node; give that "
                              "instead of --ntasks")
        if nodes is None or max_nodes < nodes:
            _fail("max_nodes", max_nodes, "is the top of a node range: give --nodes MIN-MAX")
        return nodes, nodes * (per_node or 1), per_node or 1
    if ntasks is not None and per_node is not None:
        if ntasks % per_node:
            _fail("ntasks", ntasks, f"is not a multiple of --ntasks-per-node={per_node}")
        if nodes is not None and nodes * per_node != ntasks:
            raise SubmitError(f"--nodes={nodes} x --ntasks-per-node={per_node} is "
                              f"{nodes * per_node} tasks, but --ntasks={ntasks}: give two of "
                              "the three, or make them agree")
        return ntasks // per_node, ntasks, per_node
    if ntasks is not None:
        nodes = nodes or 1
        if nodes > ntasks:
            raise SubmitError(f"--nodes={nodes} is more nodes than --ntasks={ntasks} tasks")
        return nodes, ntasks, (ntasks // nodes if ntasks % nodes == 0 else None)
    nodes, per_node = nodes or 1, per_node or 1
    return nodes, nodes * per_node, per_node


def _check_gpus(o):
    if o.gpus_per_node and o.gres and re.search(r"(^|,)gpu(:|,|$)", o.gres):
        raise SubmitError(f"--gpus-per-node={o.gpus_per_node} and --gres={o.gres} both ask for "
                          "GPUs; SLURM rejects the pair. Give one of them")
    if o.gpus_per_node and not re.fullmatch(r"([A-Za-z0-9_.-]+:)?\d+", o.gpus_per_node):
        _fail("gpus_per_node", o.gpus_per_node, "use COUNT or TYPE:COUNT, e.g. 4 or a100:4")
    if o.backend == "nccl" and not (o.gpus_per_node or o.gres):
        return ("the nccl backend needs GPUs but neither --gpus-per-node nor --gres asks for "
                "them; on most clusters the tasks will see none",)
    return ()


def _check_preempt(o):
    notes = []
    if o.preempt_signal.upper().removeprefix("SIG") not in _SIGNALS:
        _fail("preempt_signal", o.preempt_signal, f"use one of {', '.join(_SIGNALS)}")
    if o.signal_before is not None:
        if o.signal_before > MAX_SIGNAL_SECONDS:
            _fail("signal_before", o.signal_before, f"sbatch allows at most {MAX_SIGNAL_SECONDS}")
        limit = time_seconds(o.time) if o.time else None
        if limit is not None and o.signal_before >= limit:
            raise SubmitError(f"--signal-before={o.signal_before} s is not shorter than "
                              f"--time={o.time} ({limit} s): the signal would come at the start")
        if o.time is None:
            notes.append("--signal-before without --time: the signal comes that long before "
                         "the partition's time limit")
    elif o.requeue:
        notes.append("--requeue without --signal-before: SLURM requeues the job after a node "
                     "failure or preemption, but the job gets no warning to checkpoint")
    if o.requeue and o.nodes > 1 and not o.max_nodes:
        notes.append(f"--requeue with --nodes={o.nodes}: a job requeued after a node failure waits "
                     f"for {o.nodes} nodes again; --nodes={o.nodes - 1}-{o.nodes} lets it start on "
                     "the nodes left")
    return tuple(notes)


def _check_names(o):
    for option in ("output", "error"):
        path = getattr(o, option)
        if path and "%x" in path and "/" in o.name:
            raise SubmitError(f"job name {o.name!r} contains '/', and --{option}={path!r} puts "
                              "the name into a file name (%x): choose a name without '/'")
    if o.mail_type:
        bad = [t for t in o.mail_type.upper().split(",") if t not in MAIL_TYPES]
        if bad:
            _fail("mail_type", o.mail_type, f"unknown {', '.join(bad)}; use a comma-separated "
                                            f"list of {', '.join(MAIL_TYPES)}")
    if o.array and not _ARRAY.fullmatch(o.array):
        _fail("array", o.array, "use indexes like 0-15, 1,3,5, 0-15:4 or 0-99%10")
    for option in ("partition", "account", "qos"):
        value = getattr(o, option)
        if value is not None and not _WORD.fullmatch(value):
            _fail(option, value, "use letters, digits and _ . : + - only")
    for raw in o.sbatch_options:
        if not re.fullmatch(r"--?[A-Za-z][A-Za-z0-9-]*(=.*)?", raw, re.DOTALL):
            _fail("sbatch_option", raw, "give one sbatch option per use, like --reservation=NAME "
                                        "or --exclusive")
    if o.mem and o.mem_per_cpu:
        raise SubmitError("--mem and --mem-per-cpu are mutually exclusive in SLURM: give one")


_CHECKS = {
    "nodes": _nodes, "max_nodes": _count, "ntasks": _count, "ntasks_per_node": _count, "cpus_per_task": _count,
    "signal_before": lambda o, v: _count(o, v, 1),
    "mem": _memory, "mem_per_cpu": _memory, "time": _time,
    "exclusive": _flag, "requeue": _flag, "module": _flag, "preflight": _flag,
    "args": _strings, "setup": _lines, "sbatch_options": _strings,
    "env": lambda o, v: _pairs(v),
}


def check(name: str, value):
    """Return one option's value checked and normalised (name with _ or -); raise SubmitError."""
    name = name.replace("-", "_")
    if name not in OPTION_NAMES:
        raise SubmitError(f"unknown option {name.replace('_', '-')!r}; known: "
                          f"{', '.join(n.replace('_', '-') for n in OPTION_NAMES)}")
    checker = _CHECKS.get(name)
    if checker is not None:
        return checker(name, value)
    if name == "gpus_per_node" and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return _text(name, value)


def make(values: Mapping) -> SubmitOptions:
    """Return validated SubmitOptions from option names and values; raise SubmitError."""
    given = {}
    for key, value in values.items():
        if value is not None:
            given[key.replace("-", "_")] = check(key, value)
    if "script" not in given:
        raise SubmitError("no SCRIPT to run")
    if given.get("backend", "auto") not in BACKENDS:
        _fail("backend", given["backend"], f"use one of {', '.join(BACKENDS)}")
    if given.get("launcher", "srun") not in LAUNCHERS:
        _fail("launcher", given["launcher"], f"use one of {', '.join(LAUNCHERS)}")
    if isinstance(given.get("nodes"), tuple):
        given["nodes"], given["max_nodes"] = given["nodes"]
    if given.get("max_nodes") is not None and given.get("max_nodes") == given.get("nodes"):
        del given["max_nodes"]
    nodes, ntasks, per_node = _layout(given.get("nodes"), given.get("ntasks"),
                                      given.get("ntasks_per_node"), given.get("max_nodes"))
    opts = SubmitOptions(**{**given, "nodes": nodes, "ntasks": ntasks, "ntasks_per_node": per_node})
    if opts.launcher == "mpirun" and opts.mpi:
        raise SubmitError(f"--mpi={opts.mpi} is an srun option; with --launcher=mpirun leave it out")
    if opts.launcher == "mpirun" and opts.max_nodes:
        raise SubmitError(f"--nodes={opts.node_range} with --launcher=mpirun: a node range needs srun, "
                          "which starts --ntasks-per-node tasks on each node SLURM gives")
    _check_names(opts)
    return replace(opts, notes=_check_gpus(opts) + _check_preempt(opts))
