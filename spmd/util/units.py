"""Sizes in bytes as people write them: '8', '4K', '1MiB', '256M' (binary units)."""

import re

from spmd.errors import SettingsError

__all__ = ["parse_size", "format_size"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text):
    """Return the bytes in '8', '4K', '1MiB', '256M' (binary units); else raise SettingsError (a ValueError)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    unit = m and m.group(2).upper()
    if not m or unit not in _UNITS:
        raise SettingsError(f"not a size: {text!r}; write bytes, or a number with K, M or G (binary)")
    return int(m.group(1)) * _UNITS[unit]


def format_size(n):
    """Return n bytes as '8 B', '4 KiB', '256 MiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"
