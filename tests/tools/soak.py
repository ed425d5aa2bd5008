"""A soak: many short jobs back to back, some two at a time, each checked; nothing may remain.

Run from the repository root:

    python tests/tools/soak.py --jobs 200 --seed 1 --table docs-table.md

Each job runs tests/worlds/soak_job.py under ``spmd run -n 2`` (gloo) or MPICH's
``mpirun -n 2 python -m spmd`` (gloo or mpi, by SPMD_BACKEND), its kind drawn at random
(seeded): success (exit 0), raise (rank 1 raises ValueError after a collective: non-zero,
its traceback exactly once), sigkill (rank 1 SIGKILLs itself while rank 0 waits in a
collective: non-zero), hang (rank 1 never comes to the collective rank 0 waits in, with
SPMD_TIMEOUT=3: a timeout error, non-zero) and launcher-kill (the soak SIGKILLs the
launcher process itself once every rank is ready: every process of the job must be gone).
About a quarter of the jobs run as concurrent pairs.

Each promise is timed from the moment both ranks printed READY (the fault is triggered
right after; interpreter start and ``import torch`` on oversubscribed cores are not part of
it), and must hold within its bound (BOUNDS: the promise plus SLACK seconds).

Leftovers, after each job (or pair) and again every ~20 jobs and at the end, against what
was there before the soak:

- processes: any process whose environment or command line holds the job's mark
  (tests/support.py's ``left_behind``: still alive 1 s after the launcher's exit; killed);
- ports: a new LISTEN entry in /proc/net/tcp or /proc/net/tcp6 held by one of the soak's
  processes or by none, and still there SETTLE s later (a process whose environment no
  longer reads is still closing its files; one another user's live process holds is not
  the soak's);
- shm: a /dev/shm segment that one of the job's ranks had mapped (each rank prints its
  mappings before READY) and that remains once the job has ended; a new, unheld segment
  that no job named is listed as "unattributed" (another user's job, perhaps), not counted;
- sockets: a socket file under the jobs' private TMPDIR or XDG_RUNTIME_DIR (where spmd
  run --preload-keep's kept fork servers listen, spmd/launch/forkserver/kept.py: given a
  usable XDG_RUNTIME_DIR they do not use /tmp/spmd-<uid>), and a new named unix socket in
  /proc/net/unix held by a soak process or by none;
- temp files: any other file or directory left under those directories;
- mpirun files: a new /tmp/hydra_hwloc_xmlfile_* of this user's.  MPICH's mpiexec (5.0.2)
  writes the host's topology there for its proxies and removes it at exit, except when the
  job ends in MPI_Abort or mpiexec is killed: then it stays (5.5 KB), whatever the ranks do.  These
  are mpirun's own, out of the job's reach (a rank cannot tell which file is its mpirun's,
  and ending the job any other way than MPI_Abort is unreliable under hydra: its status can
  be that of a rank it killed, or it does not end the others at all), so they are counted
  in their own column but do not fail the soak (LAUNCHERS_OWN).

Leftover shm segments and temporary files are counted, then removed (with --no-clean,
kept), so that one leak is counted once and a long soak does not fill /dev/shm.

Output: a Markdown table, printed and written to --table, and the details of every
unexpected job and leftover under it. Exit status 1 if any job was unexpected or anything
was left over.
"""

import argparse
import collections
import functools
import os
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support import MPIRUN, PY, WORLDS, clean_env, hydra_files, left_behind, marked, start, tool  # noqa: E402

JOB = WORLDS / "soak_job.py"
KINDS = ("success", "raise", "sigkill", "hang", "launcher-kill")
LAUNCHERS = {  # name: (command before the script, SPMD_BACKEND)
    "spmd-run/gloo": (lambda: [tool("spmd"), "run", "-n", "2"], "gloo"),
    "mpirun/gloo": (lambda: [MPIRUN, "-n", "2", PY, "-m", "spmd"], "gloo"),
    "mpirun/mpi": (lambda: [MPIRUN, "-n", "2", PY, "-m", "spmd"], "mpi"),
}
HANG_TIMEOUT = 3  # SPMD_TIMEOUT of the hang kind, seconds
TIMEOUT = 60  # SPMD_TIMEOUT of the other kinds: a job that hangs anyway fails in spmd's words
SLACK = 20  # seconds added to each promise: two cores shared with other users' tests
CRASH = 10  # a failure that needs no timeout ends the job within this (tests/failfast/test_faults.py)
BOUNDS = {  # seconds from both ranks ready to the job's end (launcher-kill: to its last process gone)
    "success": SLACK,
    "raise": CRASH + SLACK,
    "sigkill": CRASH + SLACK,
    "hang": HANG_TIMEOUT + SLACK,
    "launcher-kill": SLACK,
}
START_LIMIT = 240  # seconds from a launcher's start to both ranks ready (not a promise: a hard limit)
SETTLE = 3.0  # seconds a port or socket found after a job may take to close before it counts as left
CHECK_EVERY = 20  # jobs between checks against what was there before the soak
CATEGORIES = ("processes", "ports", "shm", "sockets", "temp files", "mpirun files")
#: What the launcher itself leaves, not the job (see "mpirun files" above): counted, removed, no failure.
LAUNCHERS_OWN = ("mpirun files",)
RAISED = "ValueError: soak: rank 1 raised on purpose"
TRACEBACK = "Traceback (most recent call last)"
TIMED_OUT = f"timed out after {HANG_TIMEOUT} s"


# -- the draw ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    index: int
    kind: str
    launcher: str


def draw(n, seed):
    """Return n jobs drawn with seed: every kind x launcher once per round of 15, in random order
    (``rounds``)."""
    picked = rounds(n, random.Random(seed), KINDS, tuple(LAUNCHERS))
    return [Job(i + 1, k, launcher) for i, (k, launcher) in enumerate(picked)]


def rounds(n, rng, kinds, launchers):
    """Return n (kind, launcher) pairs drawn with rng: every pair once per round, in random order.

    A partial round prefers kinds, then launchers, not drawn yet, so a draw of as many as
    there are kinds has every kind, a full round every pair, and any longer draw every pair
    about equally often (tests/cluster/soak.py draws its jobs so too).
    """
    combos = [(k, launcher) for k in kinds for launcher in launchers]
    picked = []
    while len(picked) < n:
        pool = combos[:]
        rng.shuffle(pool)
        if n - len(picked) >= len(pool):
            picked += pool
            continue
        round_ = []
        while len(picked) + len(round_) < n:
            kinds_in = {k for k, _ in round_}
            launchers_in = {launcher for _, launcher in round_}
            best = min(pool, key=lambda c: (c[0] in kinds_in, c[1] in launchers_in))
            pool.remove(best)
            round_.append(best)
        picked += round_
    rng.shuffle(picked)
    return picked


def schedule(jobs, seed):
    """Group jobs into slots run one after another: about a quarter of the jobs in concurrent pairs."""
    rng = random.Random(f"{seed}-pairs")
    pairs = round(len(jobs) / 8)  # 2 jobs each: a quarter of them
    slots_count = len(jobs) - pairs
    paired = set(rng.sample(range(slots_count), pairs)) if pairs else set()
    slots, it = [], iter(jobs)
    for s in range(slots_count):
        slots.append((next(it), next(it)) if s in paired else (next(it),))
    return slots


# -- what the system holds: snapshots and their difference ----------------------------------


def listening(paths=("/proc/net/tcp", "/proc/net/tcp6")):
    """Return {description: inode} of the LISTEN sockets in /proc/net/tcp and tcp6."""
    found = {}
    for path in paths:
        try:
            lines = Path(path).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10 or f[3] != "0A":  # 0A: TCP_LISTEN
                continue
            addr, port = f[1].split(":")
            if len(addr) == 8:
                addr = socket.inet_ntoa(bytes.fromhex(addr)[::-1])
            found[f"{Path(path).name} {addr}:{int(port, 16)} (inode {f[9]})"] = f[9]
    return found


def unix_sockets(path="/proc/net/unix"):
    """Return {description: inode} of the named (or abstract) unix sockets in /proc/net/unix."""
    found = {}
    try:
        lines = Path(path).read_text().splitlines()[1:]
    except OSError:
        return found
    for line in lines:
        f = line.split(None, 7)
        if len(f) == 8:
            found[f"unix {f[7].strip()} (inode {f[6]})"] = f[6]
    return found


def walk(root):
    """Return {path: is a socket} for everything under root (root itself excluded)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            try:
                found[p] = stat.S_ISSOCK(os.lstat(p).st_mode)
            except OSError:
                pass
    return found


def snapshot(dirs):
    """Return {category: {item: key}} of what the soak looks for (not processes: marks find those).

    dirs are the directories whose every entry counts (the jobs' private ones); key is the
    inode of a socket (to find who holds it), else the path.
    """
    files = {}
    for d in dirs:
        files.update(walk(d))
    return {
        "ports": listening(),
        "shm": {f"/dev/shm/{name}": f"/dev/shm/{name}" for name in _listdir("/dev/shm")},
        "sockets": {**{p: p for p, sock in files.items() if sock}, **unix_sockets()},
        "temp files": {p: p for p, sock in files.items() if not sock},
        "mpirun files": {p: p for p in hydra_files()},
    }


def _listdir(path):
    try:
        return os.listdir(path)
    except OSError:
        return []


def diff(before, after):
    """Return {category: {item: key}} of what after holds and before does not (every category)."""
    return {c: {item: key for item, key in after.get(c, {}).items() if item not in before.get(c, {})}
            for c in CATEGORIES if c != "processes"}


def holders(needles):
    """Return {needle: {pid}} of the processes with an fd (or, for a /dev/shm path, a mapping) of each.

    needles are socket inodes (as strings) and /dev/shm paths.
    """
    found = collections.defaultdict(set)
    if not needles:
        return found
    inodes = {f"socket:[{n}]": n for n in needles if n.isdigit()}
    paths = {n for n in needles if n.startswith("/")}
    for name in _listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        for fd in _listdir(f"/proc/{name}/fd"):
            try:
                target = os.readlink(f"/proc/{name}/fd/{fd}")
            except OSError:
                continue
            if target in inodes:
                found[inodes[target]].add(pid)
            elif target in paths:
                found[target].add(pid)
        if paths:
            try:
                maps = Path(f"/proc/{name}/maps").read_text()
            except OSError:
                continue
            for p in paths:
                if p in maps:
                    found[p].add(pid)
    return found


def is_foreign(pid, runid):
    """Tell whether pid is another user's live process: its environment and command line lack runid.

    A process that is exiting reads an empty environment while it still holds its files (the
    kernel drops its memory first): it may be one of the soak's, so it is not foreign.
    """
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        if runid.encode() in environ + Path(f"/proc/{pid}/cmdline").read_bytes():
            return False
        # An empty environment: exiting (no memory left), or a live process started with none.
        return bool(environ) or bool(Path(f"/proc/{pid}/maps").read_bytes())
    except OSError:
        return False


def attribute(new, runid, named_shm):
    """Split what is new into (leftovers, unattributed): {category: [item]} each.

    A socket or segment that only other users' live processes hold is theirs: neither. A port
    or socket held by a soak process, an exiting process or none is a leftover (the caller
    gives a closing one SETTLE s). A segment is a leftover if a job's rank named it, else
    unattributed.
    """
    keys = {key for c in ("ports", "sockets", "shm") for key in new[c].values()}
    held = holders(keys) if keys else {}
    left, unattributed = {c: [] for c in CATEGORIES}, {c: [] for c in CATEGORIES}
    for c in ("ports", "sockets", "shm"):
        for item, key in sorted(new[c].items()):
            pids = held.get(key, set())
            if pids and all(is_foreign(p, runid) for p in pids):
                continue
            if c == "shm" and item not in named_shm:
                unattributed[c].append(item)
            else:
                left[c].append(item)
    left["temp files"] = sorted(new["temp files"])
    left["mpirun files"] = sorted(new["mpirun files"])
    return left, unattributed


def settle(left, dirs):
    """Drop from left's ports and sockets those gone within SETTLE s (a process still exiting closes them)."""
    deadline = time.monotonic() + SETTLE
    while (left["ports"] or left["sockets"]) and time.monotonic() < deadline:
        time.sleep(0.2)
        now = snapshot(dirs)
        for c in ("ports", "sockets"):
            left[c] = [i for i in left[c] if i in now[c]]


# -- one job ---------------------------------------------------------------------------------


@dataclass
class Result:
    job: Job
    paired: bool = False
    status: int = None
    seconds: float = None  # from both ranks ready to the end (launcher-kill: to its last process gone)
    problems: list = field(default_factory=list)
    left: dict = field(default_factory=lambda: {c: [] for c in CATEGORIES})
    shm: set = field(default_factory=set)  # the segments its ranks had mapped
    out: str = ""

    @property
    def unexpected(self):
        return bool(self.problems)


def run_job(job, root, runid, paired=False):
    """Run one job; return its Result (processes left behind are killed and listed in left)."""
    result = Result(job, paired)
    mark = f"{runid}-job{job.index}-"  # the dash: job 16's mark is no part of job 163's
    gate = Path(root) / "gates" / f"job{job.index}"
    gate.mkdir(parents=True)
    prefix, backend = LAUNCHERS[job.launcher]
    env = clean_env(SOAK_MARK=mark, SOAK_GATE=gate, TMPDIR=Path(root) / "tmp", XDG_RUNTIME_DIR=Path(root) / "run",
                    SPMD_BACKEND=backend, SPMD_TIMEOUT=HANG_TIMEOUT if job.kind == "hang" else TIMEOUT)
    proc = start(prefix() + [JOB, job.kind, mark], env)
    lines, ready = [], threading.Event()
    ready_at, count = [None], [0]

    def read():
        for line in proc.stdout:
            lines.append(line)
            count[0] += line.count("READY rank")  # Hydra may run one rank's line into the next's
            if ready_at[0] is None and count[0] >= 2:
                ready_at[0] = time.monotonic()
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    bound = BOUNDS[job.kind]
    if job.kind == "launcher-kill":
        if ready.wait(START_LIMIT):
            pids = set(marked(mark))  # the ranks (and Hydra's proxies): their environment holds the mark
            os.kill(proc.pid, signal.SIGKILL)  # the launcher itself, not its process group
            killed = time.monotonic()
            proc.wait()  # reaped here: the launcher is gone
            # A dying process's environment reads empty before its files are closed: wait
            # for each one to be gone or a zombie, and for any the mark finds meanwhile.
            while time.monotonic() - killed < bound:
                pids |= set(marked(mark))
                if not alive(pids):
                    result.seconds = time.monotonic() - killed
                    break
                time.sleep(0.1)
            else:
                result.problems.append(f"processes of the job still alive {bound} s after its launcher was "
                                       f"SIGKILLed: {sorted(alive(pids))}")
        left = left_behind(mark, grace=0)
    else:
        try:
            proc.wait(timeout=START_LIMIT + bound)
            ended = time.monotonic()
        except subprocess.TimeoutExpired:
            ended = None
            result.problems.append(f"no exit within {START_LIMIT + bound} s of its start: killed")
            _kill_group(proc)
        left = left_behind(mark, grace=1.0)
        if ended is not None and ready_at[0] is not None:
            result.seconds = ended - ready_at[0]
    if proc.poll() is None:  # launcher-kill whose launcher did not die, or a job killed above
        _kill_group(proc)
    reader.join(10)
    result.status = proc.returncode
    result.out = "".join(lines)
    shutil.rmtree(gate, ignore_errors=True)
    result.left["processes"] = [f"{pid}: {cmd}" for pid, cmd in sorted(left.items())]
    result.shm = named_segments(result.out)
    result.problems += check(job, result, bound)
    return result


def named_segments(out):
    """Return the /dev/shm paths a job's ranks printed on their SHM lines (soak_job.py)."""
    found = set()
    for m in re.finditer(r"SHM rank \d+: (.*)", out):
        line = re.split(r"SHM rank|READY rank", m[1])[0]  # a line another rank's ran into
        found.update(p for p in line.split() if p.startswith("/dev/shm/"))
    return found


def alive(pids):
    """Return the pids that are neither gone nor zombies (a zombie holds no file)."""
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            out.add(pid)
    return out


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def check(job, result, bound):
    """Return what is wrong with a job's result (empty: as expected)."""
    problems, out = [], result.out
    if out.count("READY rank") < 2:
        problems.append("not every rank printed READY")
    if job.kind == "launcher-kill":
        if result.status is not None and result.status >= 0:
            problems.append(f"the launcher exited with {result.status} before it was killed")
        return problems
    if job.kind == "success":
        if result.status != 0:
            problems.append(f"exit status {result.status}, not 0")
        if out.count("DONE rank") != 2:
            problems.append(f"{out.count('DONE rank')} DONE lines, not 2")
    elif result.status in (0, None):
        problems.append(f"exit status {result.status}, not non-zero")
    if job.kind == "raise":
        for words in (RAISED, TRACEBACK):
            if out.count(words) != 1:
                problems.append(f"{words!r} {out.count(words)} times, not once")
    if job.kind == "hang" and TIMED_OUT not in out:
        problems.append(f"{TIMED_OUT!r} missing from its output")
    if result.seconds is not None and result.seconds > bound:
        problems.append(f"ended {result.seconds:.1f} s after both ranks were ready (bound {bound} s)")
    return problems


# -- the soak --------------------------------------------------------------------------------


def soak(jobs, seed, root, log=functools.partial(print, flush=True), clean=True):
    """Run the soak; return (results, final leftovers, unattributed, checkpoints)."""
    runid = f"spmd-soak-{uuid.uuid4().hex[:10]}"
    dirs = [Path(root) / "tmp", Path(root) / "run"]
    for d in dirs:
        d.mkdir(mode=0o700)
    baseline = snapshot(dirs)
    slots = schedule(draw(jobs, seed), seed)
    results, unattributed, checkpoints, done, next_check = [], {c: set() for c in CATEGORIES}, [], 0, CHECK_EVERY
    began = time.monotonic()
    for slot in slots:
        before = snapshot(dirs)
        if len(slot) == 1:
            got = [run_job(slot[0], root, runid)]
        else:
            got = [None, None]

            def one(i):
                got[i] = run_job(slot[i], root, runid, paired=True)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        named = set().union(*(r.shm for r in got))
        left, odd = attribute(diff(before, snapshot(dirs)), runid, named)
        settle(left, dirs)
        for c in CATEGORIES:
            unattributed[c].update(odd[c])
            for r in got:  # a pair's leftover is counted on both its jobs, a segment on the job that mapped it
                mine = [i for i in left[c] if i not in r.left[c] and (c != "shm" or i in r.shm)]
                r.left[c] = r.left[c] + mine
        if clean:
            _remove(left["shm"] + left["temp files"] + left["mpirun files"]
                    + [s for s in left["sockets"] if s.startswith("/")])
        for r in got:
            done += 1
            results.append(r)
            flag = "UNEXPECTED " + "; ".join(r.problems) if r.unexpected else "ok"
            lost = ", ".join(f"{len(v)} {c}" for c, v in r.left.items() if v)
            secs = "-" if r.seconds is None else f"{r.seconds:.1f} s"
            log(f"[{done}/{jobs} {time.monotonic() - began:.0f} s] job {r.job.index} {r.job.kind} "
                f"{r.job.launcher}{' (pair)' if r.paired else ''}: status {r.status}, {secs}, {flag}"
                + (f"; LEFT {lost}" if lost else ""))
        if done >= next_check or done == jobs:
            next_check += CHECK_EVERY
            time.sleep(1.0)
            now, _ = attribute(diff(baseline, snapshot(dirs)), runid, set().union(*(r.shm for r in results)))
            settle(now, dirs)
            now["processes"] = [f"{pid}: {cmd}" for pid, cmd in sorted(left_behind(runid, grace=0).items())]
            checkpoints.append((done, now))
            log(f"check after {done} jobs, against before the soak: "
                + ", ".join(f"{len(now[c])} {c}" for c in CATEGORIES))
    final = checkpoints[-1][1] if checkpoints else {c: [] for c in CATEGORIES}
    return results, final, {c: sorted(v) for c, v in unattributed.items()}, checkpoints


def _remove(paths):
    for p in sorted(paths, key=len, reverse=True):  # what is inside a directory first
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.unlink(p)
        except OSError:
            pass


# -- the table -------------------------------------------------------------------------------


def statuses(codes):
    """Return '0 x12, 1 x3' for a list of exit statuses (None: no status), most frequent first."""
    counts = collections.Counter(codes)
    order = sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))
    return ", ".join(f"{'-' if c is None else c} x{n}" for c, n in order)


def table(results, final):
    """Return the Markdown table of results (rows by kind x launcher) and the final leftovers."""
    rows = ["| kind | launcher/backend | jobs | in pairs | statuses seen | unexpected | worst end (s) | bound (s) | "
            + " | ".join(CATEGORIES) + " |",
            "|" + "---|" * (8 + len(CATEGORIES))]

    def row(kind, launcher, rs, bound, left):
        times = [r.seconds for r in rs if r.seconds is not None]
        worst = f"{max(times):.1f}" if times else "-"
        return (f"| {kind} | {launcher} | {len(rs)} | {sum(r.paired for r in rs)} | "
                f"{statuses([r.status for r in rs])} | {sum(r.unexpected for r in rs)} | {worst} | {bound} | "
                + " | ".join(str(n) for n in left) + " |")

    groups = collections.defaultdict(list)
    for r in results:
        groups[(r.job.kind, r.job.launcher)].append(r)
    rank = {k: i for i, k in enumerate(KINDS + tuple(LAUNCHERS))}
    for (kind, launcher), rs in sorted(groups.items(), key=lambda kv: (rank.get(kv[0][0], 99),
                                                                        rank.get(kv[0][1], 99))):
        left = [sum(len(r.left[c]) for r in rs) for c in CATEGORIES]
        rows.append(row(kind, launcher, rs, BOUNDS.get(kind, "-"), left))
    rows.append(row("**all**", "", results, "", [len({i for r in results for i in r.left[c]}) for c in CATEGORIES]))
    rows.append("| **remaining at the end** | | | | | | | | "
                + " | ".join(str(len(final[c])) for c in CATEGORIES) + " |")
    return "\n".join(rows) + "\n"


def read_table(text):
    """Return the rows of the first Markdown table in text as dicts by column name (for the tests)."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    if len(lines) < 2:
        return []
    cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    names = cells(lines[0])
    return [dict(zip(names, cells(line))) for line in lines[2:]]


def details(results, final, unattributed, checkpoints):
    """Return the Markdown details: every unexpected job and leftover, with the tail of its output."""
    parts = []
    for r in results:
        lost = {c: v for c, v in r.left.items() if v}
        if not r.unexpected and all(c in LAUNCHERS_OWN for c in lost):
            continue
        parts.append(f"### job {r.job.index}: {r.job.kind} under {r.job.launcher}{' (pair)' if r.paired else ''}, "
                     f"status {r.status}, " + ("-" if r.seconds is None else f"{r.seconds:.1f} s"))
        parts += [f"- unexpected: {p}" for p in r.problems]
        parts += [f"- left ({c}): {i}" for c, v in lost.items() for i in v]
        parts.append("\n```\n" + r.out[-2500:].rstrip() + "\n```\n")
    for done, now in checkpoints:
        if any(now.values()):
            parts.append(f"- check after {done} jobs, still there: "
                         + "; ".join(f"{c}: {', '.join(v)}" for c, v in now.items() if v))
    if any(unattributed.values()):
        parts.append("- new during the soak, held by no process and not named by any job (another user's?), "
                     "not counted: " + "; ".join(f"{c}: {', '.join(v)}" for c, v in unattributed.items() if v))
    return ("\n## Details\n\n" + "\n".join(parts) + "\n") if parts else ""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--table", help="write the Markdown table (and details) to this file too")
    ap.add_argument("--no-clean", dest="clean", action="store_false",
                    help="keep leftover shm segments, temporary files and mpirun's (counted either way)")
    args = ap.parse_args(argv)
    if MPIRUN is None:
        sys.exit("soak: MPICH's mpirun not found (pip install mpich)")
    root = tempfile.mkdtemp(prefix="soak-")  # under this process's own TMPDIR; the jobs get root/tmp
    began = time.monotonic()
    try:
        results, final, unattributed, checkpoints = soak(args.jobs, args.seed, root, clean=args.clean)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = (f"Soak: {args.jobs} jobs, seed {args.seed}, {time.monotonic() - began:.0f} s. Times are from both "
            "ranks ready; launcher-kill's status is the launcher's (SIGKILLed by the soak), its time until its last "
            "process was gone. A pair's leftovers count on both its jobs (the **all** row counts each once), "
            "a /dev/shm segment on the job whose ranks had mapped it. mpirun files are MPICH's mpiexec's own, "
            "left after every job that ends in MPI_Abort: counted, removed, not a failure.\n\n"
            + table(results, final) + details(results, final, unattributed, checkpoints))
    print("\n" + text)
    if args.table:
        Path(args.table).write_text(text)
    bad = any(r.unexpected for r in results) \
        or any(v for r in results for c, v in r.left.items() if c not in LAUNCHERS_OWN) \
        or any(v for c, v in final.items() if c not in LAUNCHERS_OWN)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
