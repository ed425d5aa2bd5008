"""Talking to SLURM: preflight, submission, the submission record, waiting for the end.

- ``sbatch_variables(environ)``: SBATCH_* variables, which override a batch file's
  directives, as 'NAME=value' lines to report.
- ``test_only(path)``: ``sbatch --test-only`` and its verdict (sbatch writes it on stderr).
- ``submit(path)``: ``sbatch --parsable``; the job id is what precedes ';cluster'.
- ``write_record(...)``: a JSON file beside the batch file with the command line, the
  file's sha256, the job id and the time, so that a user can find what was submitted.
- ``wait(job_id)``: polls ``scontrol show job`` (``sacct`` once the job has left the
  controller) until every task of the job has ended; ``exit_status`` makes an exit code.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from spmd.util.atomic import atomic_write
from spmd.submit.options import SubmitError

__all__ = ["sbatch_variables", "test_only", "parse_job_id", "submit", "write_record",
           "JobState", "job_states", "wait", "exit_status", "tail", "expand_pattern",
           "FINAL_STATES"]

FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                          "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT"})
_TIMEOUT = 120  # seconds any one SLURM command may take


def _run(argv, environ=None, timeout=_TIMEOUT):
    try:
        return subprocess.run(argv, env=None if environ is None else dict(environ), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, timeout=timeout)
    except FileNotFoundError:
        raise SubmitError(f"{argv[0]} not found: run this on a SLURM login node, or add the "
                          "SLURM commands to PATH") from None
    except subprocess.TimeoutExpired:
        raise SubmitError(f"{' '.join(argv)} did not answer within {timeout} s: is slurmctld "
                          "up? (SLURM_CONF, scontrol ping)") from None


def sbatch_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """Return 'NAME=value' for each SBATCH_* variable set, sorted."""
    env = os.environ if environ is None else environ
    return sorted(f"{k}={v}" for k, v in env.items() if k.startswith("SBATCH_"))


def have_sbatch(environ: Mapping[str, str] | None = None) -> bool:
    """Tell whether an sbatch command is on PATH."""
    env = os.environ if environ is None else environ
    return shutil.which("sbatch", path=env.get("PATH")) is not None


def test_only(path, environ=None) -> tuple[bool, str]:
    """Run ``sbatch --test-only path``; return (accepted, sbatch's verdict)."""
    done = _run(["sbatch", "--test-only", str(path)], environ)
    verdict = "\n".join(s for s in (done.stderr.strip(), done.stdout.strip()) if s)
    return done.returncode == 0, verdict or f"sbatch --test-only exited with {done.returncode}"


def parse_job_id(text: str) -> tuple[str, str | None]:
    """Return (job_id, cluster) from ``sbatch --parsable`` output ('123' or '123;cluster')."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    m = re.fullmatch(r"(\d+)(?:;(\S+))?", lines[-1]) if lines else None
    if not m:
        raise SubmitError(f"cannot find a job id in sbatch's output {text!r}; expected "
                          "'JOBID' or 'JOBID;CLUSTER'")
    return m[1], m[2]


def submit(path, environ=None) -> tuple[str, str | None, list[str]]:
    """Submit path with ``sbatch --parsable``; return (job_id, cluster, command)."""
    command = ["sbatch", "--parsable", str(path)]
    done = _run(command, environ)
    if done.returncode:
        raise SubmitError(f"sbatch refused {path} (exit {done.returncode}):\n"
                          f"{(done.stderr or done.stdout).strip()}")
    job_id, cluster = parse_job_id(done.stdout)
    return job_id, cluster, command


def write_record(batch_path, command, job_id, cluster=None, submit_argv=None) -> Path:
    """Write BATCH.json beside the batch file and return its path."""
    batch_path = Path(batch_path)
    record = {
        "job_id": job_id,
        "cluster": cluster,
        "batch_file": str(batch_path.resolve()),
        "sha256": hashlib.sha256(batch_path.read_bytes()).hexdigest(),
        "sbatch_command": list(command),
        "submit_command": list(submit_argv) if submit_argv is not None else None,
        "submitted_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cwd": os.getcwd(),
    }
    out = batch_path.with_suffix(".json")
    with atomic_write(out, text=True) as f:
        f.write(json.dumps(record, indent=2) + "\n")
    return out


@dataclass(frozen=True)
class JobState:
    """One job (or array task) as SLURM reports it."""

    job_id: str
    state: str
    exit_code: int = 0
    signal: int = 0
    stdout: str | None = None
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


def _scontrol_records(text: str) -> list[JobState]:
    out = []
    for block in re.split(r"\n\s*\n", text.strip()):
        job = re.search(r"^JobId=(\d+)", block, re.M)
        state = re.search(r"^\s+JobState=(\S+)", block, re.M)
        if not job or not state:
            continue
        code = re.search(r"^\s+Requeue=.*\bExitCode=(\d+):(\d+)", block, re.M)
        stdout = re.search(r"^\s+StdOut=(.*)$", block, re.M)
        task = re.search(r"^JobId=\d+ ArrayJobId=(\d+) ArrayTaskId=(\S+)", block, re.M)
        out.append(JobState(job[1] if not task else f"{task[1]}_{task[2]}", state[1],
                            int(code[1]) if code else 0, int(code[2]) if code else 0,
                            stdout[1] if stdout else None))
    return out


def _sacct_records(text: str) -> list[JobState]:
    out = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3 and re.fullmatch(r"\d+:\d+", parts[2]):
            code, sig = parts[2].split(":")
            out.append(JobState(parts[0], parts[1].split()[0], int(code), int(sig)))
    return out


def job_states(job_id: str, environ=None) -> list[JobState] | None:
    """Return the job's records, or None when SLURM no longer knows it."""
    done = _run(["scontrol", "show", "job", job_id], environ)
    if done.returncode == 0:
        return _scontrol_records(done.stdout)
    if "Invalid job id" not in done.stderr:
        raise SubmitError(f"scontrol show job {job_id} failed: {done.stderr.strip()}")
    acct = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "JobID,State,ExitCode"], environ)
    records = _sacct_records(acct.stdout) if acct.returncode == 0 else []
    return records or None


def wait(job_id: str, environ=None, interval=0.5, max_interval=5.0,
         sleep: Callable[[float], None] = time.sleep, on_change=None) -> list[JobState]:
    """Poll until every record of job_id is final; return the records."""
    last = None
    while True:
        records = job_states(job_id, environ)
        if records is None:
            raise SubmitError(f"SLURM no longer knows job {job_id} (scontrol and sacct): its end "
                              "state is unknown")
        summary = ", ".join(f"{r.job_id} {r.state}" for r in records)
        if on_change is not None and summary != last:
            on_change(records)
        last = summary
        if records and all(r.final for r in records):
            return records
        sleep(interval)
        interval = min(interval * 1.2, max_interval)


def exit_status(records: list[JobState]) -> int:
    """Return 0 when every record COMPLETED with 0, else the first failure's code (>= 1)."""
    for r in records:
        if r.exit_code:
            return r.exit_code
        if r.signal:
            return 128 + r.signal
        if r.state != "COMPLETED":
            return 1
    return 0


def expand_pattern(pattern: str, job_id: str, name: str, user: str | None = None) -> str | None:
    """Expand %j %x %u %% in an output pattern; None if other patterns remain."""
    user = user or os.environ.get("USER") or ""
    out = re.sub(r"%%|%j|%x|%u", lambda m: {"%%": "\0", "%j": job_id, "%x": name,
                                           "%u": user}[m[0]], pattern)
    return None if "%" in out else out.replace("\0", "%")


def tail(path, lines=20) -> str:
    """Return the last lines of a text file ('' if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def say(text: str) -> None:
    """Write a status line to stderr."""
    print(text, file=sys.stderr, flush=True)
