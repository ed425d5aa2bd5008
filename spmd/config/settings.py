"""Every setting the runtime reads, parsed once from init's arguments and the environment.

    settings = Settings.parse(os.environ, backend="gloo")
    settings.timeout        # 1800.0 unless timeout= or SPMD_TIMEOUT says otherwise

An argument of init wins over its ``SPMD_*`` variable, which wins over the
default.  Parsing is pure (the environment is an argument) and checks every
value: a bad one raises SettingsError naming the variable (or argument), the
value and what is allowed; an unknown backend raises BackendError.  Where
the launcher put this rank (SPMD_RANK, SPMD_SIZE, ...) is read by
spmd.config.placement, not here.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Mapping, Optional

from spmd.errors import BackendError, SettingsError
from spmd.util.units import parse_size

__all__ = [
    "Settings",
    "BACKENDS",
    "DEFAULT_TIMEOUT",
    "VARIABLES",
    "parse_backend",
    "parse_timeout",
    "parse_heartbeat",
    "DEFAULT_HEARTBEAT",
    "parse_keep_results",
    "parse_preempt_signal",
    "parse_torch_group",
    "parse_tag_output",
    "parse_hierarchy",
    "HIERARCHY",
    "parse_pipelined",
    "PIPELINED",
    "parse_max_restarts",
]

#: Every backend name spmd knows; "auto" picks one of the others at init.
BACKENDS = ("auto", "gloo", "nccl", "mpi")
#: Seconds init and every collective may wait for the other ranks.
DEFAULT_TIMEOUT = 1800.0
#: Seconds between the fail-fast hub's heartbeats; a side silent for 5 of them (10 s) is declared lost.
DEFAULT_HEARTBEAT = 2.0

#: SPMD_HIERARCHY's values: reduce within each host first where it helps (auto), for every backend
#: that can (on), never (off).  spmd.comms.hierarchy says which backends and arrays.
HIERARCHY = ("auto", "on", "off")
#: SPMD_PIPELINED's values: large broadcasts as a chain and all_gathers as a ring where it helps (auto), for
#: every backend that can (on), never (off).  spmd.comms.pipelined says which backends and arrays.
PIPELINED = ("auto", "on", "off")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Settings:
    """What this process was asked for, checked; made by ``Settings.parse``."""

    backend: str = "auto"
    """Backend asked for, one of BACKENDS: init's backend=, else SPMD_BACKEND."""
    timeout: float = DEFAULT_TIMEOUT
    """Seconds init and each collective may wait: timeout=, else SPMD_TIMEOUT."""
    debug: bool = False
    """Compare every collective's fingerprint across ranks first: debug=, else SPMD_DEBUG."""
    trace: Optional[str] = None
    """Path of a Chrome trace written at finalize: trace=, else SPMD_TRACE; None: no trace."""
    keep_results: Optional[int] = None
    """Bytes of result buffers kept for reuse (SPMD_KEEP_RESULTS); None: the pool's default."""
    port: Optional[int] = None
    """Rendezvous port of a SLURM step (SPMD_PORT); None: derived from job and step ids."""
    preempt_signal: Optional[int] = None
    """Signal that warns of the end (SPMD_PREEMPT_SIGNAL); None: not asked for (USR1 if used)."""
    listen_fd: Optional[int] = None
    """Listening socket spmd run bound for rank 0's store (SPMD_LISTEN_FD); None: bind one."""
    torch_group: Optional[bool] = None
    """Start torch.distributed's default group beside MPI on the mpi backend: torch_group=,
    else SPMD_TORCH_GROUP; None: auto (on when torch is imported at init)."""
    tag_output: bool = False
    """Prefix each line of stdout and stderr with '[rank] ' (SPMD_TAG_OUTPUT), like spmd run."""
    hints: bool = True
    """Rank 0 says in one line when the job is set up slower than it could be (SPMD_HINTS; default on)."""
    heartbeat: float = DEFAULT_HEARTBEAT
    """Seconds between the hub's heartbeats, both ways (SPMD_HEARTBEAT); 0: none (a silent host is then
    noticed only by a collective's timeout)."""
    preflight: Optional[bool] = None
    """Connect every pair of hosts before the backend starts, MPI_Init included (SPMD_PREFLIGHT=1); None
    (unset): only before MPICH's MPI_Init under Hydra across hosts, over its key-value space; False: never."""
    hierarchy: str = "auto"
    """Large all_reduces of a world across hosts go within each host first (SPMD_HIERARCHY), one of HIERARCHY."""
    pipelined: str = "auto"
    """Large broadcasts go down a chain and all_gathers round a ring (SPMD_PIPELINED), one of PIPELINED."""

    @classmethod
    def parse(cls, environ: Mapping[str, str], backend=None, timeout=None, debug=None,
              trace=None, torch_group=None) -> "Settings":
        """Return the settings from init's arguments, else environ's SPMD_* variables, else defaults."""
        return cls(
            backend=parse_backend(environ, backend),
            timeout=parse_timeout(environ, timeout),
            debug=_parse_flag(environ, "SPMD_DEBUG", debug),
            trace=_parse_trace(environ, trace),
            keep_results=parse_keep_results(environ),
            port=_parse_port(environ),
            preempt_signal=parse_preempt_signal(environ),
            listen_fd=_parse_listen_fd(environ),
            torch_group=parse_torch_group(environ, torch_group),
            tag_output=parse_tag_output(environ),
            hints=_parse_flag(environ, "SPMD_HINTS", None) if environ.get("SPMD_HINTS", "").strip() else True,
            preflight=_parse_flag(environ, "SPMD_PREFLIGHT", None) if environ.get("SPMD_PREFLIGHT", "").strip()
            else None,
            heartbeat=parse_heartbeat(environ),
            hierarchy=parse_hierarchy(environ),
            pipelined=parse_pipelined(environ),
        )


#: Each field's variable.
VARIABLES = {
    "backend": "SPMD_BACKEND",
    "timeout": "SPMD_TIMEOUT",
    "debug": "SPMD_DEBUG",
    "trace": "SPMD_TRACE",
    "keep_results": "SPMD_KEEP_RESULTS",
    "port": "SPMD_PORT",
    "preempt_signal": "SPMD_PREEMPT_SIGNAL",
    "listen_fd": "SPMD_LISTEN_FD",
    "torch_group": "SPMD_TORCH_GROUP",
    "tag_output": "SPMD_TAG_OUTPUT",
    "hints": "SPMD_HINTS",
    "preflight": "SPMD_PREFLIGHT",
    "heartbeat": "SPMD_HEARTBEAT",
    "hierarchy": "SPMD_HIERARCHY",
    "pipelined": "SPMD_PIPELINED",
}


def parse_backend(environ: Mapping[str, str], backend=None) -> str:
    """Return the backend asked for by argument, else SPMD_BACKEND, else 'auto'."""
    name = backend or environ.get("SPMD_BACKEND") or "auto"
    name = name.strip().lower()
    if name not in BACKENDS:
        source = "backend argument" if backend else "SPMD_BACKEND"
        raise BackendError(
            f"unknown backend {name!r} (from {source}); expected one of {', '.join(BACKENDS)}"
        )
    return name


def parse_timeout(environ: Mapping[str, str], timeout=None) -> float:
    """Return seconds from the timeout argument (a number or timedelta), else SPMD_TIMEOUT, else 1800."""
    source = "the timeout argument" if timeout is not None else "SPMD_TIMEOUT"
    value = timeout if timeout is not None else environ.get("SPMD_TIMEOUT")
    if value is None or value == "":
        return DEFAULT_TIMEOUT
    if hasattr(value, "total_seconds"):
        value = value.total_seconds()
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds > 0:
        raise SettingsError(
            f"timeout must be a positive number of seconds, got {value!r} from {source} "
            f"(for example 600, or unset it for the default {DEFAULT_TIMEOUT:g})"
        )
    return seconds


def parse_heartbeat(environ: Mapping[str, str]) -> float:
    """Return seconds between heartbeats from SPMD_HEARTBEAT (0: none), else DEFAULT_HEARTBEAT."""
    text = environ.get("SPMD_HEARTBEAT", "")
    if text.strip() == "":
        return DEFAULT_HEARTBEAT
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise SettingsError(
            f"SPMD_HEARTBEAT={text!r} is not a number of seconds: use 0 or more (for example 5; 0 turns the "
            f"heartbeat off), or unset it for the default {DEFAULT_HEARTBEAT:g}"
        )
    return seconds


def _parse_flag(environ, name, value):
    if value is not None:
        return bool(value)
    text = environ.get(name, "").strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise SettingsError(
        f"{name}={environ[name]!r} is not on or off: use 1, true, yes or on to turn it on, "
        "0, false, no, off or nothing to leave it off"
    )


def parse_tag_output(environ: Mapping[str, str]) -> bool:
    """Return whether SPMD_TAG_OUTPUT asks for '[rank] ' before each output line (off if unset)."""
    return _parse_flag(environ, "SPMD_TAG_OUTPUT", None)


def parse_torch_group(environ: Mapping[str, str], torch_group=None) -> Optional[bool]:
    """Return True, False, or None for auto: the torch_group argument, else SPMD_TORCH_GROUP."""
    if isinstance(torch_group, bool):
        return torch_group
    source = "the torch_group argument" if torch_group is not None else "SPMD_TORCH_GROUP"
    value = torch_group if torch_group is not None else environ.get("SPMD_TORCH_GROUP", "")
    text = value.strip().lower() if isinstance(value, str) else None
    if text in ("", "auto"):
        return None
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    shown = f"SPMD_TORCH_GROUP={value!r}" if source == "SPMD_TORCH_GROUP" else f"{value!r} from {source}"
    raise SettingsError(
        f"{shown} is not auto, on or off: use auto (or nothing) to start torch.distributed's "
        "group beside MPI when torch is imported, 1, true, yes or on to always start it, "
        "0, false, no or off to never start it"
    )


def _auto_on_off(environ: Mapping[str, str], name: str, uses: str) -> str:
    """Return the variable name as "auto" (unset or blank), "on" or "off"; uses says what each value does."""
    value = environ.get(name, "")
    text = value.strip().lower() or "auto"
    if text in ("auto", "on", "off"):
        return text
    if text in _TRUE:
        return "on"
    if text in _FALSE:
        return "off"
    raise SettingsError(f"{name}={value!r} is not auto, on or off: use {uses}")


def parse_hierarchy(environ: Mapping[str, str]) -> str:
    """Return SPMD_HIERARCHY as one of HIERARCHY ("auto" when unset or blank)."""
    return _auto_on_off(
        environ, "SPMD_HIERARCHY",
        "auto (or nothing) to reduce large all_reduces within each host first where the backend gains by it, "
        "on to do so on every backend that can, off to keep every all_reduce flat")


def parse_pipelined(environ: Mapping[str, str]) -> str:
    """Return SPMD_PIPELINED as one of PIPELINED ("auto" when unset or blank)."""
    return _auto_on_off(
        environ, "SPMD_PIPELINED",
        "auto (or nothing) to send large broadcasts down a chain of the ranks and large all_gathers round a "
        "ring where the backend gains by it, on to do so on every backend that can, off to keep the backend's own")


def _parse_trace(environ, trace):
    path = trace if trace is not None else environ.get("SPMD_TRACE")
    return path or None


def parse_keep_results(environ: Mapping[str, str]) -> Optional[int]:
    """Return the bytes in SPMD_KEEP_RESULTS, or None when it is unset or blank."""
    text = environ.get("SPMD_KEEP_RESULTS", "")
    if text.strip() == "":
        return None
    try:
        return parse_size(text)
    except ValueError:
        raise SettingsError(
            f"SPMD_KEEP_RESULTS={text!r} is not a size: write bytes, or a number with K, M or G "
            "(for example 512M), or 0 to make every result fresh"
        ) from None


def _whole(environ, name):
    """Return (text, int or None) for a variable that holds a whole number, (None, None) if unset."""
    text = environ.get(name, "")
    if text.strip() == "":
        return None, None
    try:
        return text, int(text.strip())
    except ValueError:
        return text, None


def _parse_port(environ):
    text, port = _whole(environ, "SPMD_PORT")
    if text is not None and (port is None or not 1 <= port <= 65535):
        raise SettingsError(
            f"SPMD_PORT={text!r} is not a port: use a whole number from 1 to 65535, or unset it "
            "and let spmd derive one from the SLURM job and step"
        )
    return port


def _parse_listen_fd(environ):
    text, fd = _whole(environ, "SPMD_LISTEN_FD")
    if text is not None and (fd is None or fd < 0):
        raise SettingsError(
            f"SPMD_LISTEN_FD={text!r} is not a file descriptor: spmd run sets it to a whole "
            "number, 0 or more; unset it if it came from somewhere else"
        )
    return fd


def parse_preempt_signal(environ: Mapping[str, str], name=None) -> Optional[int]:
    """Return the number of signal name ('USR1', 'SIGUSR1', '10'), else of SPMD_PREEMPT_SIGNAL, else None."""
    source = "argument" if name is not None else "SPMD_PREEMPT_SIGNAL"
    value = name if name is not None else environ.get("SPMD_PREEMPT_SIGNAL")
    text = str(value if value is not None else "").strip()
    if text == "":
        return None
    if text.isdigit():
        if 0 < int(text) < signal.NSIG:
            return int(text)
    else:
        key = text.upper() if text.upper().startswith("SIG") else "SIG" + text.upper()
        number = signal.Signals.__members__.get(key)
        if number is not None:
            return int(number)
    raise SettingsError(
        f"unknown signal {text!r} (from {source}); use a name like USR1, SIGUSR2, TERM, "
        f"or a number from 1 to {signal.NSIG - 1}"
    )


def parse_max_restarts(environ: Mapping[str, str], value=None, option="--max-restarts") -> int:
    """Return how often spmd run relaunches a failed job: value (from option), else SPMD_MAX_RESTARTS, else 0."""
    text = value if value is not None else environ.get("SPMD_MAX_RESTARTS", "")
    if value is None and str(text).strip() == "":
        return 0
    try:
        count = int(str(text).strip()) if not isinstance(text, (bool, float)) else -1
    except ValueError:
        count = -1
    if count < 0:
        shown = f"SPMD_MAX_RESTARTS={text!r}" if value is None else f"{option} {text!r}"
        raise SettingsError(
            f"{shown} is not a number of restarts: use a whole number, 0 or more "
            "(0, the default, runs the job once; 2 relaunches a failed job up to twice)"
        )
    return count
