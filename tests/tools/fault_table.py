"""Print docs/reliability.md's table: every fault scenario under every launcher, timed.

Run from the repository root: python tests/tools/fault_table.py
It uses the same harness as tests/test_faults.py.
"""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_faults import LAUNCHERS, TIMEOUT, play  # noqa: E402

SCENARIOS = [
    ("a rank raises before a collective", "raise", 2, {}),
    ("a rank is SIGKILLed inside a collective", "sigkill", 3, {}),
    ("a rank never starts", "late", 2, {}),
    ("ranks call different collectives", "mismatch", 2, {}),
    ("... the same, in debug mode", "mismatch", 2, {"SPMD_DEBUG": 1}),
    ("all_reduce shapes differ, debug mode", "shapes", 2, {"SPMD_DEBUG": 1}),
    ("a peer never comes to an all_gather", "stall", 2, {}),
]


def headline(out):
    """Return the most telling line of a run's output."""
    patterns = (r"spmd\.errors\.\w+: .*", r"### spmd: .*", r"spmd run: .*", r".*Error: .*",
                r"EXIT STRING: .*")
    for pattern in patterns:
        found = re.findall(pattern, out)
        if found:
            return found[0][:160].replace("|", "/")
    return "(no message)"


def main():
    print(f"SPMD_TIMEOUT={TIMEOUT} s; seconds from every rank being ready (or from the start, "
          "for a rank that never starts) to the launcher's exit.\n")
    print("| scenario | launcher | exit | seconds | message |")
    print("|---|---|---|---|---|")
    for title, scenario, size, env in SCENARIOS:
        for launcher in LAUNCHERS:
            code, out, seconds = play(launcher, scenario, size, **env)
            print(f"| {title} | {launcher} | {code} | {seconds:.1f} | `{headline(out)}` |", flush=True)


if __name__ == "__main__":
    main()
