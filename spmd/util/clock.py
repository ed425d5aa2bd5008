"""How long this process has been running, for reports that separate start-up from work."""

from __future__ import annotations

import os

__all__ = ["process_age"]


def process_age() -> float | None:
    """Seconds since this process started (a forked rank: since its fork), from Linux's /proc; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None
