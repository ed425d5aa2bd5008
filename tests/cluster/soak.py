"""A soak across hosts: many short jobs over the lab's three hosts, each a success or a host fault, each
checked; nothing of any job may remain on any host.

    python -m tests.cluster.soak --jobs 100 --seed 1 --table T.md

Each job runs tests/worlds/soak_hosts.py under one of LAUNCHERS: MPICH's mpiexec from the login host
(Hydra reaching each host through the lab's enter script) on the mpi or the gloo backend, or torchrun,
one agent per host with its static rendezvous at the job's first host.  Its layout is 3 hosts x 1 rank
or 2 hosts x 2 ranks (two of the three hosts, drawn).  SPMD_HEARTBEAT=1 (silence after 5 s) and
SPMD_TIMEOUT=60, so that a job that ends soon after a fault was ended by the heartbeat.  Its kind,
drawn (seeded) from KINDS:

- ``success``: every launcher exits 0 and rank 0's CHECK is the expected sum;
- ``lossy``: 3 % of one host's packets dropped each way while the job runs (lab.lose): as success, and
  the host's firewall counted packets dropped both ways;
- ``cut`` (the host's link down), ``drop`` (a silent partition between it and the job's other hosts),
  ``freeze`` (every process of it SIGSTOPped), ``kill`` (every process of it SIGKILLed, the launcher's
  proxy or agent included): the struck host is drawn among the job's hosts, rank 0's included, and
  struck once every rank printed READY and a drawn 0-1 s later, so that the fault finds the ranks
  computing or inside an all_reduce.

A fault's promises, timed from the fault: within BOUND s no rank of the job is left on the other hosts;
spmd's words name the struck host (``no word from h2 (rank 1) ...``, ``... on h2 died ...``), or Hydra's
``BAD TERMINATION`` came first (a kill under mpiexec: Hydra ends every rank within 0.1 s, before spmd's
heartbeat can speak); at most one report ends the whole job; no launcher on the hosts left exits 0.
Then the fault is healed (the link mended, the partition's rules removed, the host thawed) and every
process of the job, on every host and the launcher, must be gone within HEAL_BOUND s: a rank cut off
or frozen ends itself once it runs again and finds rank 0's hub gone.

Leftovers, after each job, on every host (each host's own /proc, network and /dev/shm, read from this
machine through the host's holder process), against what the host held before the soak:

- processes: any process on the machine whose environment holds the job's mark (the lab's hosts'
  processes are this machine's too, in PID namespaces below it), still there 1 s after the job ended;
- ports: a new LISTEN socket in a host's /proc/net/tcp or tcp6, still there SETTLE s later;
- sockets: a new named unix socket in a host's /proc/net/unix, or a socket file under the job's TMPDIR;
- shm: a new entry in a host's /dev/shm, or a new System V shared memory segment, semaphore set or
  message queue in its IPC namespace;
- temp files: any other file under the job's TMPDIR (one directory, which every host sees);
- launcher files: what the launchers leave of their own, counted but not a failure (as tests/tools/soak.py's
  LAUNCHERS_OWN): MPICH's mpiexec's topology file (/tmp/hydra_hwloc_xmlfile_*), which it leaves when it is
  killed or its proxy dies, and torch's under TMPDIR: torchrun's log directories (``torchelastic_*``:
  one per agent, never removed, whatever the job does) and, rarely, inductor's cache directory
  (``torchinductor_<user>``, a cache kept on purpose; seen once in 100 jobs, on a torchrun agent's
  failed exit barrier).

What is left is counted, then removed (the lab's hosts reset), so one leak counts once.  The output is
a Markdown table, printed and written to --table, with the details of every unexpected job under it;
the exit status is 1 if any job was unexpected or anything was left.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.cluster.host_faults import job_processes
from tests.cluster.runs import MPIEXEC, PY, Watched, env
from tests.support import REPO, hydra_files, marked
from tests.tools.soak import listening, read_table, rounds, statuses, unix_sockets, walk

__all__ = ["KINDS", "FAULTS", "LAUNCHERS", "CATEGORIES", "draw", "soak", "table", "read_table", "main"]

JOB = REPO / "tests" / "worlds" / "soak_hosts.py"
TORCHRUN = str(REPO / ".venv" / "bin" / "torchrun")
FAULTS = ("cut", "drop", "freeze", "kill")
KINDS = ("success", "lossy", *FAULTS)
LAUNCHERS = ("mpiexec/mpi", "mpiexec/gloo", "torchrun/gloo")
LAYOUTS = ("3x1", "2x2")
ROUNDS = {"success": 60, "lossy": 60}  # a fault's job runs far longer than it will live
FAULT_ROUNDS = 2000
LOSS = 0.03
HEARTBEAT = 1  # SPMD_HEARTBEAT: silence after 5 missed beats
BOUND = 5 * HEARTBEAT + 10  # s from the fault to the last rank on the hosts left gone
HEAL_BOUND = 20  # s from the fault healed to the job's last process gone, anywhere
START_LIMIT = 180  # s from the launch to every rank READY (not a promise: a hard limit)
SUCCESS_LIMIT = 120  # s from READY to a success's end
SETTLE = 3.0
CATEGORIES = ("processes", "ports", "sockets", "shm", "temp files", "launcher files")
LAUNCHERS_OWN = ("launcher files",)
TORCH_OWN = re.compile(r"/(torchelastic|torchinductor)_[^/]+")
REPORT = re.compile(r"^### spmd: .*; ending(?: the job)?$", re.M)
#: Hydra's own words when it ends the job because a proxy died (a kill: before spmd's heartbeat can speak).
HYDRA_SAW = re.compile(r"BAD TERMINATION|control_cb .*assert \(!closed\) failed")


@dataclass(frozen=True)
class Job:
    index: int
    kind: str
    launcher: str
    hosts: tuple[str, ...]  # rank 0's first
    per_host: int
    struck: str | None  # the host the fault (or the loss) strikes
    delay: float  # s after READY

    @property
    def ranks(self):
        return len(self.hosts) * self.per_host

    def ranks_on(self, host):
        i = self.hosts.index(host)
        return list(range(i * self.per_host, (i + 1) * self.per_host))


@dataclass
class Result:
    job: Job
    statuses: list = field(default_factory=list)  # each launcher's; None: killed by the soak
    ended: float | None = None  # s from the fault (a success: from READY) to the last rank on the hosts left gone
    healed: float | None = None  # s from the healing to the job's last process gone
    problems: list = field(default_factory=list)
    left: dict = field(default_factory=lambda: {c: [] for c in CATEGORIES})
    out: str = ""

    @property
    def unexpected(self):
        return bool(self.problems)


# -- the draw ------------------------------------------------------------------------------


def draw(n, seed, hosts=("h1", "h2", "h3")):
    """Return n jobs drawn with seed: every kind x launcher once per round of 18, in random order
    (tests/tools/soak.py's ``rounds``); each job's layout, struck host and delay drawn too."""
    rng = random.Random(seed)
    picked = rounds(n, rng, KINDS, LAUNCHERS)
    jobs = []
    for i, (kind, launcher) in enumerate(picked):
        layout = rng.choice(LAYOUTS)
        used = tuple(hosts) if layout == "3x1" else tuple(sorted(rng.sample(hosts, 2)))
        struck = rng.choice(used)
        jobs.append(Job(i + 1, kind, launcher, used, 1 if layout == "3x1" else 2, struck, round(rng.random(), 2)))
    return jobs


# -- what a host holds ---------------------------------------------------------------------


def host_snapshot(lab, host):
    """{category: {item}} of host's listening ports, unix sockets, /dev/shm entries and System V IPC
    objects, read through its holder's /proc (its network namespace, its mount namespace's /dev/shm)
    and in its IPC namespace (/proc/sysvipc shows the reader's)."""
    proc = f"/proc/{lab.host(host).holder}"
    try:
        shm = os.listdir(f"{proc}/root/dev/shm")
    except OSError:
        shm = []
    return {
        "ports": {f"{host} {d}" for d in listening((f"{proc}/net/tcp", f"{proc}/net/tcp6"))},
        "sockets": {f"{host} {d}" for d in unix_sockets(f"{proc}/net/unix")},
        "shm": {f"{host} /dev/shm/{name}" for name in shm} | {f"{host} {item}" for item in _sysv(proc)},
    }


def _sysv(proc):
    """The System V shared memory segments, semaphore sets and message queues of proc's IPC namespace."""
    listing = subprocess.run(["nsenter", f"--ipc={proc}/ns/ipc", "sh", "-c",
                              "for k in shm sem msg; do sed \"1d;s/^/sysv $k /\" /proc/sysvipc/$k; done"],
                             capture_output=True, text=True, timeout=20).stdout
    return {" ".join(line.split()[:4]) for line in listing.splitlines() if line.strip()}


def lab_snapshot(lab):
    out = collections.defaultdict(set)
    for h in lab.all_hosts():
        for category, items in host_snapshot(lab, h.name).items():
            out[category] |= items
    return out


def _strip_inode(item):
    return re.sub(r" \(inode \d+\)$", "", item)


# -- one job -------------------------------------------------------------------------------


def _launch(lab, job, mark, tmpdir, port):
    launcher, backend = job.launcher.split("/")
    rounds = ROUNDS.get(job.kind, FAULT_ROUNDS)
    extra = env(SPMD_BACKEND=backend, SPMD_TIMEOUT="60", SPMD_HEARTBEAT=str(HEARTBEAT), SPMD_SOAK_MARK=mark,
                TMPDIR=tmpdir, OMP_NUM_THREADS="1")
    if launcher == "mpiexec":
        cmd = lab.mpiexec_args(MPIEXEC, ["-n", job.ranks, "-ppn", job.per_host, PY, JOB, rounds], list(job.hosts))
        return {"login": Watched(lab.popen("login", [str(c) for c in cmd], extra))}
    master = lab.host(job.hosts[0]).address
    return {h: Watched(lab.popen(h, [TORCHRUN, "--nnodes", len(job.hosts), "--nproc-per-node", job.per_host,
                                     "--node-rank", i, "--master-addr", master, "--master-port", port, JOB, rounds],
                                 extra))
            for i, h in enumerate(job.hosts)}


def _strike(lab, job):
    h, peers = job.struck, [p for p in job.hosts if p != job.struck]
    if job.kind == "cut":
        lab.cut(h)
    elif job.kind == "drop":
        for p in peers:
            lab.drop(h, p)
    elif job.kind == "freeze":
        lab.freeze(h)
    elif job.kind == "kill":
        lab.kill_all(h)


def _heal(lab, job):
    if job.kind == "cut":
        lab.mend(job.struck)
    elif job.kind in ("drop", "lossy"):
        lab.allow(*job.hosts)
    elif job.kind == "freeze":
        lab.freeze(job.struck, False)


def _ranks_left(lab, hosts):
    return [line for h in hosts for line in job_processes(lab, h) if str(JOB) in line and "torchrun" not in line]


def _drain(watched, seconds=0.1):
    for w in watched.values():
        w.drain(seconds / len(watched))


def _done(watched):
    return all(w.proc.poll() is not None for w in watched.values())


def run_job(lab, job, root, port):
    """Run job on lab; return its Result (promises checked; leftovers not yet)."""
    mark = f"soak-{uuid.uuid4().hex[:12]}"
    tmpdir = Path(root) / f"job{job.index}"
    tmpdir.mkdir()
    result = Result(job)
    if job.kind == "lossy":
        lab.lose(job.struck, LOSS)
    watched = _launch(lab, job, mark, str(tmpdir), port)
    try:
        _run(lab, job, watched, result)
    finally:
        for w in watched.values():
            if w.proc.poll() is None:
                w.kill()
            w.drain(0.5)
        result.statuses = [w.proc.poll() for w in watched.values()]
        result.out = "".join(w.text() for w in watched.values())
        _heal(lab, job)  # in case a failure came before the healing
    _check_words(job, result)
    return result, mark, tmpdir


def _run(lab, job, watched, result):
    began = time.monotonic()
    for w in watched.values():
        w.wait_for(r"^READY \d", count=job.ranks if len(watched) == 1 else job.per_host, timeout=START_LIMIT)
    ready = time.monotonic()
    if job.kind in ("success", "lossy"):
        while not _done(watched) and time.monotonic() - ready < SUCCESS_LIMIT:
            _drain(watched, 0.3)
        result.ended = time.monotonic() - ready
        if not _done(watched):
            result.problems.append(f"a {job.kind} job still ran {SUCCESS_LIMIT} s after READY (started in "
                                   f"{ready - began:.0f} s)")
        if job.kind == "lossy" and not all(dropped for _, dropped in lab.losses(job.struck).values()):
            result.problems.append(f"{job.struck}'s link lost no packet one way: {lab.losses(job.struck)}")
        return
    time.sleep(job.delay)
    struck = time.monotonic()
    _strike(lab, job)
    others = [h for h in job.hosts if h != job.struck]
    while time.monotonic() - struck < BOUND + 20:
        _drain(watched, 0.3)
        if not _ranks_left(lab, others):
            result.ended = time.monotonic() - struck
            break
    if result.ended is None or result.ended > BOUND:
        result.problems.append(f"ranks on {', '.join(others)} still there {BOUND} s after {job.struck} was struck"
                               if result.ended is None else f"the ranks on the hosts left took {result.ended:.1f} s "
                               f"(bound {BOUND} s)")
    survivors = {h: w for h, w in watched.items() if h != job.struck}  # torchrun's agents left, or mpiexec
    deadline = time.monotonic() + 10
    while not all(w.proc.poll() is not None for w in survivors.values()) and time.monotonic() < deadline:
        _drain(watched, 0.3)
    for host, w in survivors.items():
        code = w.proc.poll()
        if code == 0 or (code is None and host != "login"):
            result.problems.append(f"the launcher on {host} {'exited 0' if code == 0 else 'still ran'} after "
                                   f"{job.struck} was struck")
    healing = time.monotonic()
    _heal(lab, job)
    while time.monotonic() - healing < HEAL_BOUND:
        _drain(watched, 0.3)
        if _done(watched) and not _ranks_left(lab, job.hosts):
            result.healed = time.monotonic() - healing
            break
    if result.healed is None:
        result.problems.append(f"the job still had processes {HEAL_BOUND} s after {job.struck} was healed")


def _check_words(job, result):
    out = result.out
    if job.kind in ("success", "lossy"):
        want = sum(range(job.ranks)) * ROUNDS[job.kind] + job.ranks * sum(range(ROUNDS[job.kind]))
        if re.findall(r"^CHECK (\S+)$", out, re.M) != [f"{float(want):g}"]:
            result.problems.append(f"no CHECK {float(want):g} (or more than one)")
        if any(s != 0 for s in result.statuses):
            result.problems.append(f"statuses {result.statuses}, not all 0")
        if REPORT.search(out):
            result.problems.append("spmd reported a failure in a job that should succeed")
        return
    reports = REPORT.findall(out)
    whole = [r for r in reports if r.endswith("the job")]
    named = [r for r in reports if re.search(rf"\b{job.struck}\b", r)]
    if len(whole) > 1:
        result.problems.append(f"{len(whole)} reports ended the job, not one")
    if not named and not (job.kind == "kill" and job.launcher.startswith("mpiexec") and HYDRA_SAW.search(out)):
        result.problems.append(f"no report names {job.struck}")
    for r in reports:  # a rank on a host left blames only the struck host (the struck side sees the others go)
        said = re.match(r"### spmd: (?:rank (\d+): )?no word from (h\d)", r)
        speaker = int(said.group(1) or 0) if said else None
        if said and job.struck not in r and speaker not in job.ranks_on(job.struck):
            result.problems.append(f"a report blames {said.group(2)}, not the struck {job.struck}: {r}")


# -- leftovers -----------------------------------------------------------------------------


def leftovers(lab, mark, tmpdir, before, hydra_before):
    """{category: [item]} of what the job left (see the module), found within SETTLE s."""
    left = {c: [] for c in CATEGORIES}
    deadline = time.monotonic() + 1.0
    procs = marked(mark)
    while procs and time.monotonic() < deadline:
        time.sleep(0.1)
        procs = marked(mark)
    left["processes"] = [f"{pid} {cmd[:160]}" for pid, cmd in procs.items()]
    deadline = time.monotonic() + SETTLE
    while True:
        now = lab_snapshot(lab)
        new = {c: sorted(_strip_inode(i) for i in now[c] - before[c]) for c in ("ports", "sockets", "shm")}
        if not any(new.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    left.update(new)
    files = walk(tmpdir)
    left["sockets"] += [p for p, sock in files.items() if sock]
    left["temp files"] = [p for p, sock in files.items() if not sock and not TORCH_OWN.search(p)]
    left["launcher files"] = sorted(set(hydra_files()) - hydra_before) + [
        p for p in files if TORCH_OWN.search(p) and not TORCH_OWN.search(os.path.dirname(p))]  # the top only
    return left


def _clean(lab, result, tmpdir):
    """Remove what the job left: its processes and every host's state (the lab's reset), its files."""
    if any(v for c, v in result.left.items() if c not in LAUNCHERS_OWN) or result.unexpected:
        lab.reset()
    for path in result.left["launcher files"]:
        if os.path.isfile(path):
            os.unlink(path)
    shutil.rmtree(tmpdir, ignore_errors=True)


# -- the soak ------------------------------------------------------------------------------


def soak(lab, jobs, root, log=print):
    """Run jobs one after another on lab; return their Results."""
    lab.reset()
    before = lab_snapshot(lab)
    results = []
    for job in jobs:
        hydra_before = set(hydra_files())
        result, mark, tmpdir = run_job(lab, job, root, 29600 + job.index % 200)
        result.left = leftovers(lab, mark, tmpdir, before, hydra_before)
        _clean(lab, result, tmpdir)
        results.append(result)
        left = sum(len(v) for c, v in result.left.items() if c not in LAUNCHERS_OWN)
        log(f"# job {job.index}: {job.kind} {job.launcher} on {','.join(job.hosts)} x{job.per_host}"
            f"{' struck ' + job.struck if job.kind != 'success' else ''}: statuses {result.statuses}, "
            f"ended {_s(result.ended)}, healed {_s(result.healed)}, {'UNEXPECTED ' + '; '.join(result.problems) if result.problems else 'as promised'}"
            f"{f', {left} left' if left else ''}", flush=True)
    return results


def _s(seconds):
    return "-" if seconds is None else f"{seconds:.1f} s"


def _spread(values):
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.1f} / {max(values):.1f}" if values else "-"


def table(results):
    """The Markdown table: a row per kind x launcher, then all, then the leftovers' sum."""
    head = ("| kind | launcher/backend | jobs | statuses seen | unexpected | ended, s (median / worst) | "
            "healed, s (median / worst) | " + " | ".join(CATEGORIES) + " |")
    rows = [head, "|" + "---|" * (7 + len(CATEGORIES))]

    def row(kind, launcher, rs):
        left = [sum(len(r.left[c]) for r in rs) for c in CATEGORIES]
        return (f"| {kind} | {launcher} | {len(rs)} | {statuses([s for r in rs for s in r.statuses])} | "
                f"{sum(r.unexpected for r in rs)} | {_spread(r.ended for r in rs)} | "
                f"{_spread(r.healed for r in rs)} | " + " | ".join(map(str, left)) + " |")

    groups = collections.defaultdict(list)
    for r in results:
        groups[(r.job.kind, r.job.launcher)].append(r)
    order = {k: i for i, k in enumerate(KINDS + LAUNCHERS)}
    for (kind, launcher), rs in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], order[kv[0][1]])):
        rows.append(row(kind, launcher, rs))
    rows.append(row("**all**", "", results))
    return "\n".join(rows) + "\n"


def details(results):
    parts = []
    for r in results:
        lost = {c: v for c, v in r.left.items() if v and c not in LAUNCHERS_OWN}
        if not r.unexpected and not lost:
            continue
        j = r.job
        parts.append(f"### job {j.index}: {j.kind} under {j.launcher} on {','.join(j.hosts)} x{j.per_host}, "
                     f"struck {j.struck}, statuses {r.statuses}")
        parts += [f"- unexpected: {p}" for p in r.problems]
        parts += [f"- left ({c}): {i}" for c, v in lost.items() for i in v]
        parts.append("\n```\n" + r.out[-2500:].rstrip() + "\n```\n")
    return ("\n## Details\n\n" + "\n".join(parts) + "\n") if parts else ""


def main(argv=None):
    from tests.cluster.lab import Lab

    ap = argparse.ArgumentParser(prog="python -m tests.cluster.soak", description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--table", help="write the Markdown table (and details) to this file too")
    args = ap.parse_args(argv)
    if MPIEXEC is None:
        sys.exit("soak: MPICH's mpiexec not found (bin/setup)")
    root = tempfile.mkdtemp(prefix="soak-hosts-")
    began = time.monotonic()
    try:
        with Lab.start(hosts=3, dummy=True) as lab:
            results = soak(lab, draw(args.jobs, args.seed), root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = (f"Soak across hosts: {args.jobs} jobs over 3 hosts, seed {args.seed}, {time.monotonic() - began:.0f} s. "
            f"'ended': from the fault to the last rank on the hosts left gone (success, lossy: from READY to the "
            f"job's end); 'healed': from the fault healed to the job's last process gone anywhere. "
            f"Statuses are every launcher's (torchrun: one per host; '-': still running when looked at, the "
            f"struck host's agent before the healing).\n\n" + table(results) + details(results))
    print("\n" + text)
    if args.table:
        Path(args.table).write_text(text)
    bad = any(r.unexpected or any(v for c, v in r.left.items() if c not in LAUNCHERS_OWN) for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
