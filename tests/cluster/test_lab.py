"""The private cluster itself: it leaves nothing behind, even when its owner is killed; its link caps hold."""

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.cluster.lab import NETNS, PREFIX, STATE, Lab, sweep_openmpi
from tests.support import REPO

pytestmark = pytest.mark.cluster

OWNER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from tests.cluster.lab import Lab
lab = Lab.start(hosts=2)
print("UP", lab.name, " ".join(str(h.holder) for h in lab.all_hosts()), flush=True)
time.sleep(600)
"""


def netns_of(name):
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [ns for ns in listed if ns.startswith(name + "-")]


def test_a_killed_owner_leaves_nothing_after_the_next_start(cluster_lab):
    """SIGKILL the process that made a lab: its hosts' processes die with it at once, and the next
    Lab.start removes its namespaces, /etc/netns entries and state."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(REPO)], stdout=subprocess.PIPE, text=True)
    line = owner.stdout.readline().split()
    assert line[:1] == ["UP"], line
    name, holders = line[1], [int(p) for p in line[2:]]
    assert name.startswith(PREFIX) and len(netns_of(name)) == 4  # switch, h1, h2, login
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in holders) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in holders if os.path.exists(f"/proc/{p}")], "a host's processes outlived the lab's owner"
    Lab.start(hosts=1, dummy=False).stop()  # sweeps the dead owner's lab first
    assert netns_of(name) == []
    assert not [p for p in NETNS.iterdir() if p.name.startswith(name + "-")] if NETNS.is_dir() else True
    assert not (STATE / name).exists()


def test_a_cap_holds_on_both_ends_of_a_hosts_link(lab):
    lab.cap("h2", 50)
    for ns, dev in ((lab.host("h2").netns, "eth0"), (f"{lab.name}-sw", lab.host("h2").port)):
        shown = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
        assert "tbf" in shown and "rate 50Mbit" in shown, shown
    lab.uncap("h2")
    shown = subprocess.run(["tc", "-n", lab.host("h2").netns, "qdisc", "show", "dev", "eth0"],
                           capture_output=True, text=True).stdout
    assert "tbf" not in shown


def test_open_mpis_session_directories_are_swept_once_their_prterun_is_gone(tmp_path):
    """A prted killed with its host leaves /tmp/prted.<pid>; the next prted with that pid (the hosts' PIDs
    are small, /tmp is shared) would exit 213.  sweep_openmpi removes it once its prterun is dead, and
    leaves one whose prterun lives."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    made = {}
    for name, pid in (("dead", dead.pid), ("live", os.getpid())):
        folder = Path("/tmp") / f"prted.test-{uuid.uuid4().hex[:8]}"
        (folder / "0").mkdir(parents=True)
        (folder / f"pmix.h2.tool.prterun-login-{pid}@0").write_text("")
        made[name] = folder
    try:
        sweep_openmpi()
        assert not made["dead"].exists() and made["live"].exists()
    finally:
        for folder in made.values():
            shutil.rmtree(folder, ignore_errors=True)
