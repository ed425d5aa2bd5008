"""A private cluster on one machine: hosts made of Linux namespaces on a bridge of their own.

    with Lab.start(hosts=3) as lab:            # h1, h2, h3 and a login host
        lab.run("h2", ["hostname"])            # runs on h2: its own name, network, IPC, PIDs, /dev/shm
        lab.mpiexec(["-n", "4", "-ppn", "2", python, "job.py"], hosts=["h1", "h2"])
        lab.cut("h2")                          # h2's link goes down (lab.mend("h2") brings it back)

Each host is a network namespace with one veth (``eth0``, 198.18.0.1N/24) into a
bridge that lives in a namespace of its own (the "switch"), so the machine's own
interfaces and routes are never touched, and no host has a route anywhere else. A
process that holds the host (``sleep`` as PID 1 of a PID namespace, started by
``unshare --uts --ipc --pid --mount``) gives it its own hostname, System V IPC, PIDs
and a /dev/shm of its own: without them MPI would cross between "hosts" through
shared memory behind the network's back.  ``nsenter`` into that holder runs a
command on the host.  Each host reads its own /etc/hosts, /etc/resolv.conf (no
name server) and nsswitch.conf (files only) from /etc/netns/NAME/, so a name never
leaves the machine.

Options, each a switch a test can flip at run time:
- ``names(host, loopback=True)``: the host names itself 127.0.1.1, as Debian writes it;
  ``names(host, own=False)``: the host cannot resolve its own name at all;
- ``dummy``: at start, every host gets a second interface ``dock0``, a bridge with no port that
  holds the same address 198.19.255.1/24 on every host (as docker0 does), ahead of ``eth0``;
- ``isolate(host)`` / ``unisolate(host)``: a third interface ``lan1``, up, ahead of ``eth0``, with
  an address of its own on a network of its own (198.19.N.1/24 on hN): a veth into an otherwise
  empty namespace, so it reaches no other host (as a cluster's second network that goes nowhere
  from here); ``reset`` removes it;
- ``cap(host, mbit)``: the host's link capped both ways (tc tbf);
- ``cut(host)`` / ``mend(host)``: its link down and up; ``drop(host, peer)``: a silent
  partition, iptables DROP both ways; ``lose(host, fraction)``: packets lost at random;
  ``allow(*hosts)``: their firewall rules removed (the end of drop, lose and reject);
- ``outsider``: at start, one more host on the bridge that is in no job.

Everything is named after the lab (``spmdlab<pid>-<n>-...``).  ``stop`` (and leaving
the with block) kills every process of every host and removes every namespace
and /etc/netns entry; a lab whose owner died without stopping is removed by the
next ``Lab.start`` (``sweep``), and the holders die with the process that started
them (their parent-death signal).  ``python -m tests.cluster.lab --help`` (or
``bin/cluster``) starts one by hand: docs/testing.md.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Lab", "LabUnavailable", "SUBNET", "sweep", "sweep_openmpi"]

SUBNET = "198.18.0"  # 198.18.0.0/15: set aside for network benchmarks (RFC 2544), never a real network's
DUMMY_ADDRESS = "198.19.255.1"
ISOLATED = "198.19"  # hN's isolated lan1: 198.19.N.1/24, a network no other host is on
ETH0_INDEX = 10  # eth0's interface index: below it, room for interfaces added ahead of it later (lan1)
PREFIX = "spmdlab"
NETNS = Path("/etc/netns")
# a lab's name and its owner's PID, at the start of each of its namespaces' names: spmdlab<pid>-<n>-h1
LAB_NAME = re.compile(rf"^({PREFIX}(\d+)(?:-\d+)?)-")
STATE = Path(os.environ.get("SPMD_LAB_STATE", "/run/spmdlab"))
MACHINE_PROC = "/run/spmdlab-machine-proc"  # empty here; inside a host, the machine's /proc
REPO = Path(__file__).resolve().parents[2]


class LabUnavailable(RuntimeError):
    """A private cluster cannot be made here; the message says why."""


@dataclass
class Host:
    """One host of the lab: its name, namespace, address and holder (PID 1 of its PID namespace)."""

    name: str
    netns: str
    address: str
    port: str  # its veth's end on the switch
    holder: int = 0  # the holder's PID as this machine sees it
    unshare: subprocess.Popen | None = None


def _sh(*cmd, check=True, timeout=30):
    done = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise LabUnavailable(f"{' '.join(map(str, cmd))} failed ({done.returncode}): {done.stdout.strip()}")
    return done.stdout


def _die_with_parent():
    """In the child before exec: SIGKILL when the process that started it dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: A file of Open MPI's daemon's session directory, /tmp/prted.<its pid>/: it names the prterun it served.
_PRTERUN = re.compile(r"^pmix\.[^.]+\.tool\.prterun-[^-]+-(\d+)@")


def sweep_openmpi():
    """Remove the session directories (/tmp/prted.<pid>) of Open MPI daemons whose prterun is gone.

    A prted killed with its host (kill_all) leaves its directory, named after its pid in its host's PID
    namespace: a small number, reused by the next prted on any host of any lab, since the hosts share
    /tmp.  A prted that finds its directory taken exits 213 ("A daemon failed to report back").  The
    prterun runs on the login host, in this machine's PIDs, so whether it is alive can be told here."""
    for folder in Path("/tmp").glob("prted.*"):
        try:
            served = [int(m[1]) for m in map(_PRTERUN.match, os.listdir(folder)) if m]
        except OSError:
            continue
        if served and not any(_alive(pid) for pid in served):
            shutil.rmtree(folder, ignore_errors=True)


def sweep():
    """Remove every lab whose owner is gone: its namespaces, /etc/netns entries and state; and the
    session directories of Open MPI's daemons that nothing serves (sweep_openmpi)."""
    sweep_openmpi()
    names = _sh("ip", "netns", "list", check=False).split()
    for folder in (NETNS, STATE):
        if folder.is_dir():
            names += [p.name + ("-" if folder is STATE else "") for p in folder.iterdir()]
    labs = {}
    for name in names:
        found = LAB_NAME.match(name)
        if found:
            labs[found[1]] = int(found[2])
    for lab, pid in labs.items():
        if not _alive(pid):
            _remove(lab)


def _remove(name):
    """Kill every holder of lab name and remove its namespaces, /etc/netns entries and state."""
    state = STATE / name / "state.json"
    try:
        for pid in json.loads(state.read_text()).get("holders", {}).values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    except (OSError, ValueError):
        pass
    for ns in _sh("ip", "netns", "list", check=False).split():
        if ns.startswith(name + "-"):
            _sh("ip", "netns", "del", ns, check=False)
    if NETNS.is_dir():
        for path in NETNS.iterdir():
            if path.name.startswith(name + "-"):
                shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(STATE / name, ignore_errors=True)


def check_possible():
    """Raise LabUnavailable unless this process can make namespaces (root, iproute2, unshare, nsenter)."""
    if os.geteuid() != 0:
        raise LabUnavailable("the private cluster needs root (network namespaces)")
    for tool in ("ip", "unshare", "nsenter", "tc"):
        if shutil.which(tool) is None:
            raise LabUnavailable(f"the private cluster needs {tool} (Debian: iproute2, util-linux)")


def ensure_iptables(timeout=300):
    """Install Debian's iptables when missing (for a silent partition or packet loss)."""
    if shutil.which("iptables"):
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "install", "-y", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=120",
                 "iptables"], ["apt-get", "update"],
                ["apt-get", "install", "-y", "--no-install-recommends", "iptables"]):
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout,
                       stdin=subprocess.DEVNULL)
        if shutil.which("iptables"):
            return
    raise LabUnavailable("iptables is missing and apt-get could not install it")


class Lab:
    """A running private cluster: compute hosts h1..hN, a login host, a switch (see the module)."""

    _made = 0  # labs this process has started

    def __init__(self, name, hosts, login, outsider, directory):
        self.name, self.hosts, self.login, self.outsider, self.dir = name, hosts, login, outsider, directory
        self.enter = directory / "enter"
        self.hostfile = directory / "hostfile"
        self._names = {h.name: "real" for h in hosts}
        self._isolated = set()  # hosts with lan1 (isolate)

    # -- making and ending -----------------------------------------------------------------------

    @classmethod
    def start(cls, hosts=3, dummy=True, outsider=False, name=None):
        """Make a lab of hosts compute hosts (h1..), a login host and a switch; return it."""
        check_possible()
        sweep()
        cls._made += 1
        name = name or f"{PREFIX}{os.getpid()}-{cls._made}"  # several labs of one process do not collide
        _remove(name)
        directory = STATE / name
        directory.mkdir(parents=True, exist_ok=True)
        os.makedirs(MACHINE_PROC, exist_ok=True)
        made = [Host(f"h{i}", f"{name}-h{i}", f"{SUBNET}.{10 + i}", f"p{i}") for i in range(1, hosts + 1)]
        login = Host("login", f"{name}-login", f"{SUBNET}.2", "plogin")
        extra = Host("outsider", f"{name}-out", f"{SUBNET}.250", "pout") if outsider else None
        lab = cls(name, made, login, extra, directory)
        try:
            lab._build(dummy)
        except BaseException:
            lab.stop()
            raise
        return lab

    def _build(self, dummy):
        switch = f"{self.name}-sw"
        _sh("ip", "netns", "add", switch)
        _sh("ip", "-n", switch, "link", "set", "lo", "up")
        _sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", switch, "link", "set", "br0", "up")
        everyone = self.all_hosts()
        for host in everyone:
            _sh("ip", "netns", "add", host.netns)
            _sh("ip", "-n", host.netns, "link", "set", "lo", "up")
            if dummy and host in self.hosts:  # ahead of eth0: a lower interface index
                _sh("ip", "-n", host.netns, "link", "add", "dock0", "type", "bridge")
                _sh("ip", "-n", host.netns, "addr", "add", f"{DUMMY_ADDRESS}/24", "dev", "dock0")
                _sh("ip", "-n", host.netns, "link", "set", "dock0", "up")
            _sh("ip", "link", "add", "eth0", "index", ETH0_INDEX, "netns", host.netns, "type", "veth", "peer",
                "name", host.port, "netns", switch)
            _sh("ip", "-n", switch, "link", "set", host.port, "master", "br0", "up")
            _sh("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _sh("ip", "-n", host.netns, "link", "set", "eth0", "up")
            etc = NETNS / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "resolv.conf").write_text("# the lab's hosts have no name server\n")
            (etc / "nsswitch.conf").write_text("hosts: files\nnetworks: files\n")
            (etc / "hosts").write_text(self._hosts_file(host))
        for host in everyone:
            self._hold(host)
        self._settle(everyone)
        self.hostfile.write_text("".join(f"{h.name}\n" for h in self.hosts))
        self.enter.write_text(self._enter_script())
        self.enter.chmod(0o755)
        self._save()

    def _settle(self, hosts, seconds=10.0):
        """Wait until no host's address is still tentative (IPv6's duplicate address detection, about
        2 s after a link comes up): UCX started before that failed the first MPI job on a new lab
        ('incompatible loopback flags', 2 of 3 fresh labs; 0 of 3 after a wait)."""
        deadline = time.monotonic() + seconds
        for host in hosts:
            while _sh("ip", "-n", host.netns, "-6", "addr", "show", "tentative", check=False).strip():
                if time.monotonic() > deadline:
                    raise LabUnavailable(f"host {host.name}'s addresses still tentative after {seconds:g} s")
                time.sleep(0.1)

    def _hosts_file(self, host, own="real"):
        lines = ["127.0.0.1 localhost"]
        if own == "loopback":
            lines.append(f"127.0.1.1 {host.name}")
        for other in self.all_hosts():
            if other is not host or own == "real":
                lines.append(f"{other.address} {other.name}")
        return "\n".join(lines) + "\n"

    def _hold(self, host):
        """Start the holder: PID 1 of the host's PID namespace, with its own name, IPC and /dev/shm.

        The login host keeps the machine's PIDs: a process may enter only PID namespaces below its
        own, and Hydra's proxies start from the login host into the others."""
        own_pids = host is not self.login
        # The machine's /proc stays readable at MACHINE_PROC, so that what a host starts can enter another.
        script = (f"mount --rbind /proc {MACHINE_PROC} && mount -t proc proc /proc && " if own_pids else "") + (
            f"hostname {host.name} && mount -t tmpfs -o size=1g,mode=1777 {self.name}-shm /dev/shm && "
            # ip netns exec mounted a sysfs of the namespace's, without the cgroup mounts under it:
            # slurmd will not start without them (its cgroup plugin checks the systemd hierarchy, unused)
            f"mount -t tmpfs -o mode=755 {self.name}-cgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/systemd && "
            "mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd && "
            "echo held && exec sleep infinity")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--ipc", "--mount", "--fork", "--kill-child",
             "--propagation", "private", *(["--pid"] if own_pids else []), "sh", "-c", script],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if os.environ.get("SPMD_LAB_KEEP") != "1" else None)
        line = proc.stdout.readline().strip()
        if line != "held":
            proc.kill()
            raise LabUnavailable(f"host {host.name} did not start: {line} {proc.stdout.read()[-500:]}")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            if children:
                host.holder, host.unshare = int(children[0]), proc
                return
            time.sleep(0.01)
        raise LabUnavailable(f"host {host.name}: no holder process")

    def _enter_script(self):
        """Hydra's -launcher-exec (and Open MPI's rsh agent): drop ssh's options, enter the host, run the rest."""
        cases = "".join(f"  {h.name}|{h.address}) pid={h.holder} ;;\n" for h in self.all_hosts())
        return ("#!/bin/sh\n# Enters a host of the spmd test lab, as ssh would: enter [ssh options] HOST COMMAND...\n"
                "while [ $# -gt 0 ]; do case \"$1\" in -[oplim]) shift 2 ;; -*) shift ;; *) break ;; esac; done\n"
                "host=$1; shift\n"
                f"case \"$host\" in\n{cases}  *) echo \"enter: no host $host in the lab\" >&2; exit 255 ;;\nesac\n"
                f"p={MACHINE_PROC}/$pid/ns; [ -d \"$p\" ] || p=/proc/$pid/ns\n"
                "pid=; [ \"$(readlink $p/pid)\" = \"$(readlink /proc/self/ns/pid)\" ] || pid=--pid=$p/pid\n"
                "exec nsenter --net=$p/net --uts=$p/uts --ipc=$p/ipc $pid --mount=$p/mnt --wd=\"$PWD\" "
                "-- sh -c \"$*\"\n")

    def _save(self):
        holders = {h.name: h.holder for h in self.all_hosts() if h.holder}
        (self.dir / "state.json").write_text(json.dumps({
            "name": self.name, "holders": holders,
            "hosts": {h.name: {"netns": h.netns, "address": h.address, "port": h.port} for h in self.all_hosts()},
            "compute": [h.name for h in self.hosts]}))

    @classmethod
    def attach(cls, name):
        """The lab another process started (bin/cluster), from its state file."""
        state = json.loads((STATE / name / "state.json").read_text())
        made = {n: Host(n, d["netns"], d["address"], d["port"], state["holders"].get(n, 0))
                for n, d in state["hosts"].items()}
        return cls(name, [made[n] for n in state["compute"]], made["login"], made.get("outsider"), STATE / name)

    def stop(self):
        """Kill every process of every host; remove every namespace, /etc/netns entry and file of the lab."""
        for host in self.all_hosts():
            if host.unshare is not None:
                host.unshare.kill()
                host.unshare.wait()
        _remove(self.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # -- using it ----------------------------------------------------------------------------------

    def all_hosts(self):
        return [*self.hosts, self.login] + ([self.outsider] if self.outsider else [])

    def host(self, name):
        return next(h for h in self.all_hosts() if h.name == name)

    def command(self, host, cmd):
        """The argument list that runs cmd (a list) on host."""
        return [str(self.enter), host, *(shlex.quote(str(c)) for c in cmd)]

    def popen(self, host, cmd, env=None, **kwargs):
        """Start cmd on host, in a session of its own, output (both streams) piped as text."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.STDOUT)
        kwargs.setdefault("cwd", str(REPO))
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(self.command(host, cmd), env=env, text=True, start_new_session=True, **kwargs)

    def run(self, host, cmd, env=None, timeout=60):
        """Run cmd on host to its end (killed after timeout); return the CompletedProcess (output in stdout)."""
        proc = self.popen(host, cmd, env)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return subprocess.CompletedProcess(proc.args, None, out, "")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")

    def mpiexec_args(self, mpiexec, args, hosts=None):
        """mpiexec's command line, from the login host, reaching each compute host through enter."""
        hostfile = self.hostfile
        if hosts is not None:
            hostfile = self.dir / f"hostfile-{'-'.join(hosts)}"
            hostfile.write_text("".join(f"{h}\n" for h in hosts))
        return [mpiexec, "-launcher", "ssh", "-launcher-exec", str(self.enter), "-f", str(hostfile), *args]

    def reset(self):
        """Every host as at start: no process but its holder, its link up and uncapped, no firewall rule,
        its own name resolving to its address; no session directory of a dead Open MPI daemon left."""
        for host in self.all_hosts():
            if host is not self.login:
                self.kill_all(host.name)
                self.freeze(host.name, False)  # and the nsenter clients a freeze stopped end with their child
            self.mend(host.name)
            self.uncap(host.name)
            self.allow(host.name)
            self.names(host.name)
        for host in sorted(self._isolated):
            self.unisolate(host)
        sweep_openmpi()

    def kill_all(self, host, sig="KILL"):
        """Send sig to every process of host but its holder (as a dying host, sig KILL).  Not the login
        host: it shares the machine's PIDs, where kill -1 would reach every process of the machine."""
        if self.host(host) is self.login or not self.host(host).holder:
            raise ValueError(f"kill_all: {host} has no PID namespace of its own")
        _sh(*self.command(host, ["kill", f"-{sig}", "-1"]), check=False)

    def freeze(self, host, frozen=True):
        """SIGSTOP (or SIGCONT) every process of host but its holder.

        Thawing also continues the nsenter processes that entered host from this machine (the lab's
        ssh clients: Hydra's launcher-exec, Open MPI's rsh agent): nsenter stops itself when its child
        stops and waits for a SIGCONT that nothing inside the host can send, so a launcher would wait
        for ever on a host that was frozen once.
        """
        self.kill_all(host, "STOP" if frozen else "CONT")
        if not frozen:
            holder = f"/{self.host(host).holder}/ns/pid"
            for entry in os.listdir("/proc"):
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        args = f.read().split(b"\0")
                except (OSError, ValueError):
                    continue
                if args and args[0].endswith(b"nsenter") and any(a.endswith(holder.encode()) for a in args):
                    try:
                        os.kill(int(entry), signal.SIGCONT)
                    except (OSError, ValueError):
                        pass

    def names(self, host, loopback=False, own=True):
        """Write host's /etc/hosts: its own name as its address, as 127.0.1.1 (loopback), or absent."""
        h = self.host(host)
        text = self._hosts_file(h, "loopback" if loopback else ("real" if own else "absent"))
        with open(NETNS / h.netns / "hosts", "r+") as f:  # in place: the host's bind mount holds this inode
            f.truncate(0)
            f.write(text)

    def isolate(self, host):
        """Give host a second network interface up, lan1 (198.19.N.1/24 on hN), ahead of eth0, that reaches
        no other host: a veth whose other end is alone in a namespace of its own."""
        h = self.host(host)
        far = f"{h.netns}-lan"
        number = self.all_hosts().index(h) + 1
        _sh("ip", "netns", "add", far)
        self._isolated.add(host)
        _sh("ip", "link", "add", "lan1", "index", ETH0_INDEX - 1, "netns", h.netns, "type", "veth", "peer", "name",
            "far", "netns", far)
        _sh("ip", "-n", far, "link", "set", "far", "up")
        _sh("ip", "-n", h.netns, "addr", "add", f"{ISOLATED}.{number}.1/24", "dev", "lan1")
        _sh("ip", "-n", h.netns, "link", "set", "lan1", "up")
        self._settle([h])

    def unisolate(self, host):
        """Remove host's lan1 and the namespace of its other end."""
        h = self.host(host)
        _sh("ip", "-n", h.netns, "link", "del", "lan1", check=False)  # and its other end
        _sh("ip", "netns", "del", f"{h.netns}-lan", check=False)
        self._isolated.discard(host)

    def cut(self, host):
        _sh("ip", "-n", f"{self.name}-sw", "link", "set", self.host(host).port, "down")

    def mend(self, host):
        """Bring host's link up, and forget every host's failed neighbour entries: an address that went
        unanswered while the link was down stays 'No route to host' for a while otherwise."""
        _sh("ip", "-n", f"{self.name}-sw", "link", "set", self.host(host).port, "up")
        for other in self.all_hosts():
            _sh("ip", "-n", other.netns, "neigh", "flush", "all", check=False)
        self._settle([self.host(host)])

    def drop(self, host, peer):
        """A silent partition between host and peer: their packets dropped both ways, no reset sent."""
        ensure_iptables()
        a, b = self.host(host), self.host(peer)
        for me, other in ((a, b), (b, a)):
            _sh("ip", "netns", "exec", me.netns, "iptables", "-A", "INPUT", "-s", other.address, "-j", "DROP")
            _sh("ip", "netns", "exec", me.netns, "iptables", "-A", "OUTPUT", "-d", other.address, "-j", "DROP")

    def allow(self, *hosts):
        """Remove every firewall rule of hosts: the end of drop, lose and reject."""
        for host in hosts:
            _sh("ip", "netns", "exec", self.host(host).netns, "sh", "-c",
                "command -v iptables >/dev/null && iptables -F INPUT && iptables -F OUTPUT || true", check=False)

    def lose(self, host, fraction):
        """Drop that fraction of the packets host's link carries, at random, each way (iptables' statistic
        match on eth0: the loss of a bad cable or a congested switch port; TCP retransmits them)."""
        ensure_iptables()
        ns = self.host(host).netns
        for chain, way in (("INPUT", "-i"), ("OUTPUT", "-o")):
            _sh("ip", "netns", "exec", ns, "iptables", "-A", chain, way, "eth0")  # counts every packet
            _sh("ip", "netns", "exec", ns, "iptables", "-A", chain, way, "eth0", "-m", "statistic", "--mode",
                "random", "--probability", f"{fraction:g}", "-j", "DROP")

    def losses(self, host):
        """Return {chain: (packets, dropped)} of host's link since lose(): what its firewall counted."""
        out = {}
        for chain in ("INPUT", "OUTPUT"):
            listing = subprocess.run(["ip", "netns", "exec", self.host(host).netns, "iptables", "-L", chain, "-v",
                                      "-x", "-n"], capture_output=True, text=True, check=True).stdout
            counts = [int(line.split()[0]) for line in listing.splitlines()[2:] if line.strip()]
            out[chain] = (counts[0], counts[1])  # the counting rule, then the dropping one
        return out

    def reject(self, host, peer, port):
        """host's firewall answers TCP from peer to port with a reset (a refusal, not a silence)."""
        ensure_iptables()
        _sh("ip", "netns", "exec", self.host(host).netns, "iptables", "-A", "INPUT", "-p", "tcp", "-s",
            self.host(peer).address, "--dport", str(port), "-j", "REJECT", "--reject-with", "tcp-reset")

    def cap(self, host, mbit):
        """Cap host's link at mbit Mbit/s both ways (tc tbf on each end of its veth).

        The bucket holds 10 ms at the rate (64 KiB at least): with 64 KiB at 1 Gbit/s a stream got
        720 Mbit/s through, with 1.25 MB 905 (of the 950 TCP's payload can have)."""
        h = self.host(host)
        burst = max(64 << 10, int(mbit * 1e6 / 8 / 100))
        for ns, dev in ((h.netns, "eth0"), (f"{self.name}-sw", h.port)):
            _sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                "burst", str(burst), "latency", "50ms")

    def uncap(self, host):
        h = self.host(host)
        for ns, dev in ((h.netns, "eth0"), (f"{self.name}-sw", h.port)):
            _sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)


def _main(argv=None):
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["mpiexec"]:  # everything after it is mpiexec's
        lab = Lab.attach(f"{PREFIX}0-manual")
        mpiexec = shutil.which("mpiexec") or str(REPO / ".venv" / "bin" / "mpiexec")
        return subprocess.call(lab.command("login", lab.mpiexec_args(mpiexec, argv[1:])), cwd=os.getcwd())

    parser = argparse.ArgumentParser(
        prog="bin/cluster", description="A private cluster of namespaces on this machine, for trying jobs by hand.")
    sub = parser.add_subparsers(dest="what", required=True)
    up = sub.add_parser("up", help="make a lab and leave it running; prints how to use it")
    up.add_argument("--hosts", type=int, default=3)
    up.add_argument("--no-dummy", action="store_true", help="no second interface dock0 on the hosts")
    up.add_argument("--outsider", action="store_true")
    up.add_argument("--loopback-names", action="store_true", help="each host names itself 127.0.1.1")
    up.add_argument("--isolated", action="store_true", help="each host has lan1 too, on a network of its own")
    sub.add_parser("down", help="remove the lab that bin/cluster up made")
    run = sub.add_parser("run", help="run a command on a host: bin/cluster run h1 hostname")
    run.add_argument("host")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    sub.add_parser("mpiexec", help="MPICH's mpiexec from the login host over the compute hosts: "
                   "bin/cluster mpiexec -n 4 -ppn 2 python jobs/collectives.py")
    args = parser.parse_args(argv)
    name = f"{PREFIX}0-manual"
    if args.what == "up":
        os.environ["SPMD_LAB_KEEP"] = "1"
        _remove(name)
        lab = Lab.start(args.hosts, dummy=not args.no_dummy, outsider=args.outsider, name=name)
        for h in lab.hosts:
            lab.names(h.name, loopback=args.loopback_names)
            if args.isolated:
                lab.isolate(h.name)
        print(f"lab {name}: hosts {' '.join(h.name + '=' + h.address for h in lab.all_hosts())}\n"
              f"  bin/cluster run h1 hostname\n  bin/cluster mpiexec -n 4 -ppn 2 python jobs/collectives.py\n"
              f"  bin/cluster down")
        return 0
    if args.what == "down":
        _remove(name)
        return 0
    return subprocess.call(Lab.attach(name).command(args.host, args.cmd), cwd=os.getcwd())


if __name__ == "__main__":
    sys.exit(_main())
