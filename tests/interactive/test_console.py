"""``spmd repl`` as a user drives it: through a pseudo-terminal (pexpect), and in tmux for a real Ctrl-C."""

import os
import re
import shutil
import signal
import subprocess
import time
import uuid

import pexpect
import pytest

from tests.support import BIN, clean_env, left_behind

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(180)]

PROMPT = r"\r\n(\[[0-9,-]+\] )?>>> "


def _default_sigint():
    """In the child: SIGINT as a terminal's shell leaves it.  A runner started in the background by a
    shell without job control (CI under nohup ... &) ignores SIGINT, its children inherit that, and a
    session whose front end ignores SIGINT never hears the user's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _spawn(*args, mark):
    env = clean_env(SPMD_REPL_MARK=mark, SPMD_REPL_HISTORY=os.devnull, TERM="dumb")
    return pexpect.spawn(str(BIN / "spmd"), ["repl", *args], env=env, encoding="utf-8", timeout=60,
                         dimensions=(50, 200), preexec_fn=_default_sigint)


def _say(child, line):
    """Send a line; return what came back before the next prompt (the echo left out), as lines."""
    child.sendline(line)
    child.expect(PROMPT)
    return [ln for ln in child.before.replace("\r", "").split("\n")[1:] if ln]


def test_a_session_at_the_prompt_blocks_output_values_commands_ctrl_c_and_exit(tmp_path):
    mark = uuid.uuid4().hex
    child = _spawn("-n", "4", "--timeout", "30", mark=mark)
    child.expect(r"spmd repl: 4 ranks \(gloo\), started in [0-9.]+ s")
    child.expect(PROMPT)
    assert _say(child, "import numpy as np, os, time") == []
    child.sendline("for i in range(2):")
    child.expect(r"\.\.\. ")
    child.sendline("    print(i * comm.rank)")
    child.expect(r"\.\.\. ")
    assert _say(child, "") == ["[0-3] 0", "[0] 0", "[1] 1", "[2] 2", "[3] 3"]
    assert _say(child, "comm.all_reduce(np.ones(2) * comm.rank)") == ["[0-3] array([6., 6.])"]
    assert _say(child, "%on 0,2 print('even')") == ["[0,2] even"]
    assert _say(child, "%on 1-2") == ["spmd: statements run on rank(s) 1-2"]
    assert _say(child, "comm.rank") == ["[1] 1", "[2] 2"]
    assert _say(child, "%on all") == ["spmd: statements run on every rank"]
    assert _say(child, "%push w=[7, 8]") == []
    assert _say(child, "%pull w") == ["[[7, 8], [7, 8], [7, 8], [7, 8]]"]
    assert _say(child, "def f(:")[-1] == "SyntaxError: invalid syntax"  # shown once, by the prompt
    out = _say(child, "1 / (comm.rank % 2)")
    assert out[0] == "[1,3] 1.0" and out[1] == "[0,2] Traceback (most recent call last):"
    assert out[-1] == "[0,2] ZeroDivisionError: division by zero"
    assert _say(child, "%nope")[0] == "spmd: %nope: not a command; %help lists them"
    assert _say(child, "pid = os.getpid()") == []
    pids = [int(p) for p in re.findall(r"\d+", _say(child, "%pull pid")[0])]
    assert len(pids) == 4
    child.sendline("time.sleep(60)")
    time.sleep(1.5)
    child.sendintr()
    child.expect(PROMPT)
    said = child.before.replace("\r", "")
    assert "[0-3] KeyboardInterrupt" in said and "spmd: interrupted after" in said
    assert _say(child, "%pull pid") == [repr(pids)]  # the same ranks: a sleep is interrupted, not the world
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert left_behind(mark, grace=3.0) == {}


def test_closing_the_terminal_leaves_no_process():
    mark = uuid.uuid4().hex
    child = _spawn("-n", "2", mark=mark)
    child.expect(PROMPT)
    assert _say(child, "x = 1") == []
    child.close(force=True)  # the terminal goes: SIGHUP, then SIGKILL
    assert left_behind(mark, grace=5.0) == {}


def _tmux():
    if shutil.which("tmux") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=300",
                        "tmux"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    path = shutil.which("tmux")
    if path is None:
        pytest.fail("tmux is needed for the Ctrl-C test and could not be installed (apt-get install tmux)")
    return path


def test_ctrl_c_in_tmux_interrupts_every_rank_and_the_prompt_comes_back(tmp_path):
    tmux, mark = _tmux(), uuid.uuid4().hex
    name = f"spmd-{mark[:8]}"
    env = clean_env(SPMD_REPL_MARK=mark, SPMD_REPL_HISTORY=os.devnull)
    sock = ["-S", str(tmp_path / "tmux.sock")]

    def screen():
        return subprocess.run([tmux, *sock, "capture-pane", "-p", "-t", name], capture_output=True, text=True,
                              env=env).stdout

    def wait_for(text, within=60):
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if text in screen():
                return
            time.sleep(0.1)
        pytest.fail(f"{text!r} did not appear within {within} s; the screen:\n{screen()}")

    subprocess.run([tmux, *sock, "new-session", "-d", "-s", name, "-x", "200", "-y", "50",
                    f"{BIN / 'spmd'} repl -n 2"], env=env, check=True)
    try:
        wait_for(">>>")
        subprocess.run([tmux, *sock, "send-keys", "-t", name, "import time; time.sleep(60)", "Enter"], check=True)
        time.sleep(1.5)
        subprocess.run([tmux, *sock, "send-keys", "-t", name, "C-c"], check=True)
        wait_for("[0-1] KeyboardInterrupt", within=20)
        subprocess.run([tmux, *sock, "send-keys", "-t", name, "comm.rank * 3", "Enter"], check=True)
        wait_for("[1] 3", within=20)
        subprocess.run([tmux, *sock, "send-keys", "-t", name, "exit()", "Enter"], check=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and subprocess.run([tmux, *sock, "has-session", "-t", name],
                                                             capture_output=True).returncode == 0:
            time.sleep(0.1)
    finally:
        subprocess.run([tmux, *sock, "kill-server"], capture_output=True)
    assert left_behind(mark, grace=5.0) == {}
