"""A real SLURM on the private cluster: slurmctld on the login host, one slurmd on each compute host.

    slurm = LabSlurm.start(lab)             # nodes h1..hN, named and addressed as the lab's hosts
    lab.popen("login", ["srun", "-N", "2", ...], env=slurm.env(base))
    slurm.stop()

The daemons are tests/submit/slurm_cluster.py's (munged, slurm.conf and the rest under one
directory), started inside the lab's hosts: munged on this machine (its socket is a file,
which every host sees), slurmctld on the login host, slurmd -N hN on host hN at its own
address, so that job steps run on the hosts, with their names, networks and PIDs.
"""

from __future__ import annotations

import subprocess
import tempfile

from tests.cluster.runs import env
from tests.submit.slurm_cluster import SlurmCluster, _conf, _which

__all__ = ["LabSlurm", "job_env", "QUICK_REQUEUE"]

#: What ``start_on(lab, quick_requeue=True)`` changes, so that a job requeued for a dead node runs again within
#: a minute: a silent node is DOWN after SlurmdTimeout s (SLURM's default: 300), a step's processes are
#: killed KillWait s after SIGTERM (default 30; the lab's 5), a requeued job waits cred_expire s before it
#: may start (default 120), and the scheduler looks at the queue every sched_interval s (default 60).
QUICK_REQUEUE = {"SlurmdTimeout": "5", "KillWait": "2", "cred_expire": "5", "sched_interval": "1"}


def job_env(slurm, **extra):
    """A job's environment (tests.cluster.runs.env) for slurm's commands, with a secret folder of its own:
    job ids start at 1 in every test cluster, and a secret file of an earlier cluster's job 1 must not be read."""
    return slurm.env(env(SPMD_SECRET_DIR=tempfile.mkdtemp(prefix="spmd-secrets-"), **extra))


class LabSlurm(SlurmCluster):
    """SlurmCluster whose daemons run on the lab's hosts (see the module)."""

    lab = None  # set on the class start_on makes for one lab
    quick_requeue = False

    @classmethod
    def start_on(cls, lab, cpus=4, memory=2000, timeout=60, quick_requeue=False):
        """Start SLURM on lab's hosts; return it.  quick_requeue: QUICK_REQUEUE's settings."""
        on_lab = type(cls.__name__, (cls,), {"lab": lab, "quick_requeue": quick_requeue})
        return on_lab.start(nodes=len(lab.hosts), cpus=cpus, memory=memory, timeout=timeout)

    @classmethod
    def _make_conf(cls, root, ctld_port, node_ports, cpus, memory):
        text, _ = _conf(root, ctld_port, node_ports, cpus, memory)
        lab = cls.lab
        lines = [line for line in text.splitlines() if not line.startswith(("NodeName=", "PartitionName=",
                                                                             "SlurmctldHost="))]
        lines.append(f"SlurmctldHost=login({lab.login.address})")
        for host in lab.hosts:
            lines.append(f"NodeName={host.name} NodeHostname={host.name} NodeAddr={host.address} Port=6818 "
                         f"CPUs={cpus} RealMemory={memory} State=UNKNOWN")
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        if cls.quick_requeue:
            lines = _quick_requeue(lines)
        return "\n".join(lines) + "\n", [h.name for h in lab.hosts]

    def _spawn(self, name, cmd):
        host = "login" if name == "slurmctld" else name[len("slurmd-"):] if name.startswith("slurmd-") else None
        if host is not None:
            cmd = self.lab.command(host, cmd)
        return super()._spawn(name, cmd)

    def run(self, cmd, check=True, timeout=30):
        """A SLURM client command, from the login host."""
        done = subprocess.run(self.lab.command("login", cmd), env=self.env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check and done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr}")
        return done

    def srun(self, args, env, timeout=180):
        """srun args from the login host; return the Popen (output piped)."""
        return self.lab.popen("login", [_which("srun"), *map(str, args)], self.env(env))



def _quick_requeue(lines):
    """slurm.conf's lines with QUICK_REQUEUE's settings: two lines replaced, two options added to theirs."""
    q = QUICK_REQUEUE
    lines = [line for line in lines if not line.startswith(("SlurmdTimeout=", "KillWait="))]
    lines = [line + f",cred_expire={q['cred_expire']}" if line.startswith("AuthInfo=") else
             line + f",sched_interval={q['sched_interval']}" if line.startswith("SchedulerParameters=") else line
             for line in lines]
    return lines + [f"SlurmdTimeout={q['SlurmdTimeout']}", f"KillWait={q['KillWait']}"]
