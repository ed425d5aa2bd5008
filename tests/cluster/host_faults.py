"""A host fails while the ranks compute: strike one, time how the job ends on the hosts left.

    with Lab.start(hosts=2) as lab:
        ended = strike(lab, "torchrun", "gloo", "freeze")   # h2 frozen 1 s into 30 s of compute
        ended.ranks_end, ended.launcher_end, ended.report

The job is tests/worlds/host_fault.py, 2 hosts x 2 ranks (h1: ranks 0, 1; h2: ranks 2, 3), SPMD_TIMEOUT
60 s: far beyond the heartbeat's detection, so a job that ends sooner was not ended by a collective's
timeout.  The faults (tests/cluster/lab.py): ``cut`` h2's link down; ``drop`` h1 and h2 drop each other's
packets (a silent partition: the login host, where mpiexec runs, still reaches h2); ``freeze`` every
process of h2 SIGSTOPped; ``kill`` every process of h2 SIGKILLed (Hydra's proxy, or torchrun's agent,
included).  Times are seconds from the fault: ``ranks_end`` when no rank is left on h1, ``launcher_end``
when the launcher on h1 (mpiexec on the login host, or torchrun's agent on h1) ended by itself, None if
it still waited LAUNCHER_WAIT s after the ranks (it is then killed, and ``killed_launcher`` says so).

``python -m tests.cluster.host_faults --runs 3`` prints the table of docs/reliability.md ("Host faults").
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field

from tests.cluster.lab import SUBNET
from tests.cluster.runs import MPIEXEC, PY, Watched, env
from tests.support import REPO

__all__ = ["strike", "Ended", "FAULTS", "CELLS", "COMPUTE", "LAUNCHER_WAIT"]

JOB = REPO / "tests" / "worlds" / "host_fault.py"
TORCHRUN = str(REPO / ".venv" / "bin" / "torchrun")
FAULTS = ("cut", "drop", "freeze", "kill")
#: (launcher, backend) pairs measured.
CELLS = (("torchrun", "gloo"), ("mpiexec", "gloo"), ("mpiexec", "mpi"))
#: Seconds the ranks compute; the fault strikes 1 s in.
COMPUTE = 30
#: Seconds the launcher is given, after the ranks on h1 ended, to end by itself.
LAUNCHER_WAIT = 20
#: Processes of a host that are the lab's own, or this module's look at it, or dead: the holder, PID 1 of
#: the host, reaps no child, so a rank whose parent died stays a zombie (<defunct>) until the lab's reset.
_NOT_THE_JOB = re.compile(r"sleep infinity|pid=,args=|<defunct>")


@dataclass
class Ended:
    """How a job ended after its fault."""

    fault: str
    ranks_end: float | None = None  # seconds from the fault until no rank was left on h1
    launcher_end: float | None = None  # ... until the launcher ended by itself (None: it was killed)
    statuses: list[int | None] = field(default_factory=list)  # the launchers' (h1's first), None if killed
    left: list[str] = field(default_factory=list)  # h1's processes once the launcher ended or waited its time
    output: str = ""

    @property
    def killed_launcher(self) -> bool:
        return self.launcher_end is None

    @property
    def report(self) -> list[str]:
        """spmd's reports that end the job ('### spmd: ...; ending the job' and a rank's '...; ending')."""
        return re.findall(r"### spmd: .*?; ending(?: the job)?$", self.output, re.M)


def _job_processes(lab, host):
    """host's processes that are not the lab's: 'pid args' lines."""
    out = lab.run(host, ["ps", "-eo", "pid=,args="], timeout=20).stdout or ""
    return [line.strip() for line in out.splitlines() if line.strip() and not _NOT_THE_JOB.search(line)]


def _left(lab, host, seconds=3.0):
    """host's job processes that are still there seconds after the launcher ended (one caught exiting,
    '[python]' without its arguments, is not left)."""
    deadline = time.monotonic() + seconds
    left = _job_processes(lab, host)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _job_processes(lab, host)
    return left


def _ranks(lines):
    return [line for line in lines if str(JOB) in line and "torchrun" not in line]


def _launch(lab, launcher, backend, port, compute, extra):
    extra = dict(SPMD_BACKEND=backend, SPMD_TIMEOUT="60", **extra)
    if launcher == "mpiexec":
        cmd = lab.mpiexec_args(MPIEXEC, ["-n", "4", "-ppn", "2", PY, JOB, compute], ["h1", "h2"])
        return [Watched(lab.popen("login", [str(c) for c in cmd], env(**extra)))]
    return [Watched(lab.popen(host, [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(i),
                                     "--master-addr", f"{SUBNET}.11", "--master-port", str(port), str(JOB),
                                     str(compute)], env(**extra)))
            for i, host in enumerate(["h1", "h2"])]


def _fault(lab, fault):
    if fault == "cut":
        lab.cut("h2")
    elif fault == "drop":
        lab.drop("h1", "h2")
    elif fault == "freeze":
        lab.freeze("h2")
    else:
        lab.kill_all("h2")


def _ended(job):
    return job.proc.poll() is not None


def strike(lab, launcher, backend, fault, port=29531, limit=120, compute=COMPUTE, launcher_wait=LAUNCHER_WAIT,
           **extra):
    """Run the job (extra: more of its environment), strike h2 with fault 1 s into the compute, return how
    it ended (everything killed after limit seconds, the fault's clock)."""
    jobs = _launch(lab, launcher, backend, port, compute, extra)
    ended = Ended(fault)
    try:
        for job in jobs:  # each launcher's output holds its own host's ranks
            job.wait_for(r"COMPUTING \d", count=len(jobs) == 1 and 4 or 2, timeout=150)
        time.sleep(1.0)
        struck = time.monotonic()
        _fault(lab, fault)
        first = jobs[0]  # mpiexec, or torchrun's agent on h1
        while time.monotonic() - struck < limit:
            first.drain(0.3)
            if ended.ranks_end is None and not _ranks(_job_processes(lab, "h1")):
                ended.ranks_end = time.monotonic() - struck
            if _ended(first) and ended.launcher_end is None:
                ended.launcher_end = time.monotonic() - struck
            if ended.ranks_end is not None and (ended.launcher_end is not None
                                                or time.monotonic() - struck > ended.ranks_end + launcher_wait):
                break
        ended.statuses = [job.proc.poll() for job in jobs]
        ended.left = _left(lab, "h1")
    finally:
        for job in jobs:
            job.kill()
            job.drain(1.0)
        ended.output = "".join(job.text() for job in jobs)
    return ended


def _table(rows, runs, wait):
    """The markdown table: per cell, median and worst of the ranks' end, the launcher's, the report."""
    print("| launcher | backend | fault | ranks on h1 ended, s (median / worst) | launcher ended, s | report |")
    print("|---|---|---|---|---|---|")
    for (launcher, backend, fault), ends in rows.items():
        ranks = [e.ranks_end for e in ends if e.ranks_end is not None]
        launched = [e.launcher_end for e in ends]
        shown = (f"{statistics.median(ranks):.1f} / {max(ranks):.1f}" if len(ranks) == len(ends)
                 else f"{len(ends) - len(ranks)} of {runs} never ended")
        waits = ("still waiting after " + f"{wait:g} s (killed)" if any(x is None for x in launched)
                 else f"{statistics.median(launched):.1f} / {max(launched):.1f}")
        reports = {r for e in ends for r in e.report} or {"none"}
        print(f"| {launcher} | {backend} | {fault} | {shown} | {waits} | {' / '.join(sorted(reports))[:300]} |")


def main(argv=None):
    from tests.cluster.lab import Lab

    parser = argparse.ArgumentParser(prog="python -m tests.cluster.host_faults", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cells", default=",".join(f"{la}-{b}" for la, b in CELLS))
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--launcher-wait", type=float, default=LAUNCHER_WAIT)
    args = parser.parse_args(argv)
    rows = {}
    with Lab.start(hosts=2, dummy=False) as lab:
        for cell in args.cells.split(","):
            launcher, backend = cell.split("-")
            for fault in args.faults.split(","):
                for i in range(args.runs):
                    lab.reset()
                    try:
                        ended = strike(lab, launcher, backend, fault, port=29531 + i, launcher_wait=args.launcher_wait)
                    except BaseException as exc:  # a launch that failed (pytest.fail's Failed is no Exception)
                        if isinstance(exc, KeyboardInterrupt):
                            raise
                        print(f"# {launcher} {backend} {fault}: the run failed: {str(exc)[-2000:]}", flush=True)
                        continue
                    rows.setdefault((launcher, backend, fault), []).append(ended)
                    print(f"# {launcher} {backend} {fault}: ranks {ended.ranks_end} launcher {ended.launcher_end} "
                          f"statuses {ended.statuses} left {ended.left} report {ended.report}", flush=True)
                    if os.environ.get("SPMD_HOST_FAULTS_OUT"):
                        print(ended.output[-3000:], flush=True)
                lab.reset()
    _table(rows, args.runs, args.launcher_wait)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())
