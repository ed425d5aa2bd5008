"""Print docs/reliability.md's table: every fault scenario under every launcher, timed.

Run from the repository root: python tests/tools/fault_table.py
It uses the same harness as tests/failfast/test_faults.py; "left behind" counts the run's
processes still alive 1 s after the launcher's exit (found by the run's mark in
/proc, then killed). The srun rows come from tests/submit/test_slurm.py (the cluster).
"""

import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.failfast.test_faults import LAUNCHERS, TIMEOUT, _fuzz_then_go, play  # noqa: E402

SCENARIOS = [
    ("a rank raises before a collective", "raise", 2, {}),
    ("a rank is SIGKILLed inside a collective", "sigkill", 3, {}),
    ("a rank is SIGKILLed inside a 256 MiB gather", "gather-kill", 2, {}),
    ("a rank dies inside init", "init-death", 2, {}),
    ("a rank never starts", "late", 2, {}),
    ("ranks call different collectives", "mismatch", 2, {}),
    ("... the same, in debug mode", "mismatch", 2, {"SPMD_DEBUG": 1}),
    ("all_reduce shapes differ, debug mode", "shapes", 2, {"SPMD_DEBUG": 1}),
    ("a receive with no send", "deadlock", 2, {}),
    ("a peer never comes to an all_gather", "stall", 2, {}),
    ("an outsider fuzzes the hub, then the job ends", "outsider", 2, {"FAULTS_ENDING": "normal"}),
    ("... then a rank raises", "outsider", 2, {"FAULTS_ENDING": "raise"}),
]


def headline(out):
    """Return the most telling line of a run's output."""
    patterns = (r"spmd\.errors\.\w+: .*", r"### spmd: (?!the fail-fast hub).*", r"spmd run: .*",
                r".*Error: .*", r"EXIT STRING: .*", r"exitcode +: -?\d+ .*", r"SURVIVED .*")
    for pattern in patterns:
        found = re.findall(pattern, out)
        if found:
            return found[0][:160].replace("|", "/")
    return "(no message)"


def main():
    print(f"SPMD_TIMEOUT={TIMEOUT} s; seconds from every rank being ready (or from the start, "
          "for a rank that never starts) to the launcher's exit.\n")
    print("| scenario | launcher | exit | seconds | left behind | message |")
    print("|---|---|---|---|---|---|")
    for title, scenario, size, env in SCENARIOS:
        for launcher in LAUNCHERS:
            with tempfile.TemporaryDirectory() as tmp:
                go = Path(tmp) / "go"
                react = _fuzz_then_go(go) if scenario == "outsider" else None
                run = play(launcher, scenario, size, react=react, strict=False, FAULTS_GO=go, **env)
            left = len(run.left) or "none"
            print(f"| {title} | {launcher} | {run.code} | {run.seconds:.1f} | {left} | `{headline(run.out)}` |",
                  flush=True)


if __name__ == "__main__":
    main()
