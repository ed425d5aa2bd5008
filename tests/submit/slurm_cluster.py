"""A private SLURM cluster for the tests: munged, slurmctld and one slurmd per emulated node.

    cluster = SlurmCluster.start(nodes=4)      # or: with SlurmCluster.start() as cluster:
    subprocess.run(["sbatch", ...], env=cluster.env(os.environ))
    cluster.stop()                             # nothing of it is left running

Everything lives under one temporary directory (mode 755, as munged requires of
its socket's directories): munge key and socket, slurm.conf, state, spool, logs and
pid files. The ports are free ones picked at start. Nodes are named by loopback
addresses 127.0.0.2, 127.0.0.3, ... so that their names resolve, and declare more
CPUs than the machine has (SlurmdParameters=config_overrides). Debian's packages
are installed with apt-get when missing; ``SlurmUnavailable`` says why a cluster
cannot start (not root, packages not installable, a daemon that does not come up).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["SlurmCluster", "SlurmUnavailable", "ensure_packages", "PACKAGES"]

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
_COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel")
_SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")


class SlurmUnavailable(RuntimeError):
    """A private SLURM cluster cannot run here; the message says why."""


def _which(name):
    path = os.pathsep.join([os.environ.get("PATH", ""), *_SBIN])
    return shutil.which(name, path=path)


def _missing():
    return [c for c in _COMMANDS if _which(c) is None]


def ensure_packages(timeout=600):
    """Install Debian's SLURM and munge packages when a command is missing (needs root)."""
    if not _missing():
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"SLURM commands missing ({', '.join(_missing())}) and not root "
                               f"to install {' '.join(PACKAGES)}")
    if _which("apt-get") is None:
        raise SlurmUnavailable(f"SLURM commands missing ({', '.join(_missing())}) and no apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "--no-install-recommends",
               "-o", "DPkg::Lock::Timeout=300", *PACKAGES]
    log = []
    for cmd in (install, ["apt-get", "update", "-o", "DPkg::Lock::Timeout=300"], install):
        try:
            done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"{' '.join(cmd)} did not finish within {timeout} s") from None
        log.append(done.stdout)
        if done.returncode == 0 and cmd[1] == "install" and not _missing():
            return
    raise SlurmUnavailable(f"could not install {' '.join(PACKAGES)} with apt-get:\n"
                           + "".join(log)[-2000:])


def _free_ports(count, host="127.0.0.1"):
    """Return a run of count consecutive free TCP ports (checked by binding each)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind((host, 0))
            base = probe.getsockname()[1]
        if base + count > 60999:
            continue
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", port))
            return list(range(base, base + count))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise SlurmUnavailable(f"found no {count} consecutive free ports")


def _conf(root, ctld_port, node_ports, cpus, memory):
    hostname = socket.gethostname()
    nodes = [f"127.0.0.{i + 2}" for i in range(len(node_ports))]
    lines = [
        "ClusterName=spmdtest",
        f"SlurmctldHost={hostname}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge/munge.socket",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/run/slurmctld.pid",
        f"SlurmdPidFile={root}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "SchedulerType=sched/builtin",
        "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SlurmdParameters=config_overrides",
        "EnforcePartLimits=ALL",
        "ReturnToService=2",
        "MailProg=/bin/true",
        "JobCompType=jobcomp/none",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "KillWait=5",
        "MessageTimeout=10",
        "InactiveLimit=0",
        "MinJobAge=300",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    for name, port in zip(nodes, node_ports):
        lines.append(f"NodeName={name} NodeHostname={hostname} NodeAddr={name} Port={port} "
                     f"CPUs={cpus} RealMemory={memory} State=UNKNOWN")
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n", nodes


class SlurmCluster:
    """A running private cluster; build it with SlurmCluster.start()."""

    def __init__(self, root: Path, nodes: list[str]):
        self.root = root
        self.conf = root / "etc" / "slurm.conf"
        self.nodes = nodes
        self._procs: list[tuple[str, subprocess.Popen]] = []

    # -- starting ------------------------------------------------------------------
    @classmethod
    def _make_conf(cls, root, ctld_port, node_ports, cpus, memory):
        """slurm.conf's text and the node names (a subclass may place the daemons elsewhere)."""
        return _conf(root, ctld_port, node_ports, cpus, memory)

    @classmethod
    def start(cls, nodes=4, cpus=8, memory=4000, timeout=60):
        """Install what is missing, start the daemons, and wait until every node is idle."""
        if os.geteuid() != 0:
            raise SlurmUnavailable(f"slurmd and munged must run as root here (uid {os.geteuid()})")
        ensure_packages()
        root = Path(tempfile.mkdtemp(prefix="spmd-slurm-"))
        os.chmod(root, 0o755)
        for sub in ("etc", "munge", "state", "spool", "log", "run"):
            (root / sub).mkdir(mode=0o755)
            os.chmod(root / sub, 0o755)
        ports = _free_ports(nodes + 1)
        text, names = cls._make_conf(root, ports[0], ports[1:], cpus, memory)
        cluster = cls(root, names)
        cluster.conf.write_text(text)
        try:
            cluster._start_munge()
            cluster._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(cluster.conf)])
            for name in names:
                cluster._spawn(f"slurmd-{name}",
                               [_which("slurmd"), "-D", "-N", name, "-f", str(cluster.conf)])
            cluster._wait_idle(timeout)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start_munge(self):
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        m = self.root / "munge"
        self._spawn("munged", [_which("munged"), "-F", "--force", f"--socket={m}/munge.socket",
                               f"--key-file={key}", f"--pid-file={m}/munged.pid",
                               f"--log-file={self.root}/log/munged.log",
                               f"--seed-file={m}/munged.seed"])
        deadline = time.monotonic() + 15
        while not (m / "munge.socket").exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise SlurmUnavailable("munged did not create its socket within 15 s:\n"
                                       + self.logs())
            time.sleep(0.05)

    def _spawn(self, name, cmd):
        out = open(self.root / "log" / f"{name}.stdout", "wb")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=self.env(os.environ), start_new_session=True)
        out.close()
        (self.root / "run" / f"{name}.popen.pid").write_text(f"{proc.pid}\n")
        self._procs.append((name, proc))
        return proc

    def _check_alive(self):
        for name, proc in self._procs:
            if proc.poll() is not None:
                raise SlurmUnavailable(f"{name} exited with status {proc.returncode}:\n"
                                       + self.logs())

    def logs(self, lines=15):
        """Return the last lines of every daemon's log, for failure messages."""
        out = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            if text:
                out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)

    def _wait_idle(self, timeout):
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            self._check_alive()
            got = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=15)
            states = got.stdout
            idle = [line.split()[0] for line in states.splitlines() if line.split()[1:] == ["idle"]]
            if got.returncode == 0 and sorted(idle) == sorted(self.nodes):
                return
            time.sleep(0.2)
        raise SlurmUnavailable(f"the nodes did not become idle within {timeout} s "
                               f"(sinfo: {states.strip()!r}):\n{self.logs()}")

    # -- using ---------------------------------------------------------------------
    def env(self, base=None):
        """Return base (default: os.environ) plus SLURM_CONF and the sbin directories on PATH."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        path = env.get("PATH", "").split(os.pathsep)
        env["PATH"] = os.pathsep.join(path + [d for d in _SBIN if d not in path])
        return env

    def run(self, cmd, check=True, timeout=30):
        """Run a SLURM client command against this cluster; return the CompletedProcess."""
        done = subprocess.run(cmd, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check and done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr}")
        return done

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # -- stopping ------------------------------------------------------------------
    @classmethod
    def attach(cls, root):
        """Return a handle on a cluster left under root (to stop it)."""
        root = Path(root)
        return cls(root, [])

    def stop(self, remove=True):
        """Cancel every job, stop the daemons by their pid files, kill what they left.

        Raise RuntimeError if a process of the cluster survives; remove the directory.
        """
        if self._alive("slurmctld"):
            try:
                self.run(["scancel", "--full", "--user=root"], check=False, timeout=15)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline:
                    left = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=15)
                    if left.returncode or not left.stdout.strip():
                        break
                    time.sleep(0.2)
            except subprocess.TimeoutExpired:
                pass
        # slurmds first (they end their slurmstepds), then slurmctld, munged last.
        names = sorted(self._daemons(), key=lambda n: (not n.startswith("slurmd"), n == "munged"))
        survivors = [name for name in names if not self._stop_daemon(name)]
        leftovers = self._kill_leftovers()
        if survivors or leftovers:
            raise RuntimeError(f"processes of the test cluster under {self.root} survived: "
                               f"daemons {survivors}, others {leftovers}")
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)

    def _daemons(self):
        return [p.name[:-len(".popen.pid")] for p in (self.root / "run").glob("*.popen.pid")]

    def _pid(self, name):
        """Return the daemon's pid from its pid file if that process is still ours, else None."""
        try:
            pid = int((self.root / "run" / f"{name}.popen.pid").read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return None
        return pid if str(self.root).encode() in cmdline else None

    def _alive(self, name):
        return self._pid(name) is not None

    def _stop_daemon(self, name, grace=10):
        """Stop one daemon: SIGTERM, then SIGKILL after grace seconds; True when it is gone."""
        popen = dict(self._procs).get(name)
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5)):
            pid = self._pid(name)
            if pid is None:
                break
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if popen is not None and popen.poll() is not None:
                    break
                if popen is None and self._pid(name) is None:  # gone, or a zombie
                    break
                time.sleep(0.05)
        if popen is not None:
            try:
                popen.wait(1)
            except subprocess.TimeoutExpired:
                return False
        return self._pid(name) is None

    def _kill_leftovers(self):
        """Kill processes started for this cluster (slurmstepd, job tasks) that outlived it."""
        mark = f"SLURM_CONF={self.conf}".encode()
        survivors = []
        for _ in range(3):
            found = []
            for pid in _pids():
                if pid == os.getpid():
                    continue
                try:
                    environ = Path(f"/proc/{pid}/environ").read_bytes()
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if mark in environ.split(b"\0") or str(self.root).encode() in cmdline:
                    found.append(pid)
            if not found:
                return []
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            survivors = found
            time.sleep(0.3)
        return survivors


def _pids():
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]

