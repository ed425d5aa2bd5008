"""How each gradient travels: ``compress`` as one name for every gradient, or per parameter.

``DataParallel(compress=...)`` takes None, "fp16" or "bf16" (the dtype of
every gradient on the wire), "powersgd" or "powersgd:R" (low-rank factors of
rank R, :mod:`spmd.train.powersgd`; "powersgd" is "powersgd:4"), "auto" (chosen
per gradient from the measured link, :mod:`spmd.train.auto`), or a mapping
of parameter-name patterns (``fnmatch``, as in ``model.named_parameters()``)
to one of those: ``{"tokens.*": "bf16"}`` compresses the token embedding and
sends the rest as it is.  The first pattern that matches a name decides.
``parse_compress`` reads the command line's form, ``tokens.*=bf16,encoder.*=powersgd:4``.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Union

from spmd.errors import DataParallelError
from spmd.train.auto import AUTO
from spmd.train.buckets import COMPRESS
from spmd.train.powersgd import DEFAULT_RANK

if TYPE_CHECKING:
    from torch import nn

__all__ = ["Compress", "POWERSGD", "check_compress", "powersgd_rank", "dtype_names", "parse_compress", "describe"]

#: What ``compress`` accepts: one dtype name for every gradient, or patterns -> names.
Compress = Union[str, None, Mapping[str, Union[str, None]]]

_NAMES = "None, 'none', 'fp16', 'bf16', 'auto', 'powersgd' or 'powersgd:R' (R a positive integer)"

#: The name of PowerSGD in compress: "powersgd" or "powersgd:R".
POWERSGD = "powersgd"


def powersgd_rank(name: str | None) -> int | None:
    """Return R of a checked name "powersgd:R", None for the other names."""
    if isinstance(name, str) and name.startswith(POWERSGD + ":"):
        return int(name.partition(":")[2])
    return None


def _check_name(name: object, where: str) -> str | None:
    """Return name in one form ('powersgd:R', None for 'none'), or raise: where says where it came from."""
    if isinstance(name, str) and name.partition(":")[0] == POWERSGD:
        _, sep, rank = name.partition(":")
        if not sep:
            return f"{POWERSGD}:{DEFAULT_RANK}"
        if not (rank.isascii() and rank.isdigit() and int(rank) > 0):
            raise DataParallelError(
                f"{where} {name!r}: the rank of PowerSGD's approximation must be a positive integer, "
                f"as in 'powersgd:4' (or 'powersgd' for rank {DEFAULT_RANK})")
        return f"{POWERSGD}:{int(rank)}"
    if name == AUTO:
        return AUTO
    if not (name is None or isinstance(name, str)) or name not in COMPRESS:
        raise DataParallelError(f"{where} {name!r}; use {_NAMES}")
    return None if name == "none" else name


def check_compress(compress: Compress) -> str | None | dict[str, str | None]:
    """Return compress in one form (None for 'none'), or raise DataParallelError naming what is wrong."""
    if isinstance(compress, Mapping):
        out = {}
        for pattern, dtype in compress.items():
            if not isinstance(pattern, str) or not pattern:
                raise DataParallelError(f"compress: a pattern must be a non-empty string, got {pattern!r}")
            out[pattern] = _check_name(dtype, f"compress: {pattern!r} maps to")
        return out
    if not (compress is None or isinstance(compress, str)) or (
            compress not in COMPRESS and compress != AUTO and compress.partition(":")[0] != POWERSGD):
        raise DataParallelError(
            f"compress must be one of {_NAMES}, or a mapping of parameter-name patterns to those "
            f"(for example {{'tokens.*': 'bf16'}}); got {compress!r}")
    return _check_name(compress, "compress")


def dtype_names(model: nn.Module, compress: Compress) -> dict[int, str | None]:
    """{id(parameter): the name of how its gradient travels ('bf16', 'powersgd:4', 'auto'), or None} of the trainable ones.

    Raises if a pattern matches no trainable parameter (a typo would
    otherwise compress nothing without a word), naming some that exist.
    """
    compress = check_compress(compress)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not isinstance(compress, dict):
        return {id(p): compress for _, p in named}
    for pattern in compress:
        if not any(fnmatchcase(n, pattern) for n, _ in named):
            some = ", ".join(n for n, _ in named[:8]) + (", ..." if len(named) > 8 else "")
            raise DataParallelError(
                f"compress: the pattern {pattern!r} matches no trainable parameter; their names are "
                f"those of model.named_parameters(): {some}")
    return {id(p): next((w for pat, w in compress.items() if fnmatchcase(n, pat)), None) for n, p in named}


def parse_compress(text: str) -> str | None | dict[str, str | None]:
    """Read the command line's --compress: 'none', 'fp16', 'bf16', 'powersgd[:R]', 'auto', or 'pattern=name,pattern=name'."""
    text = text.strip()
    if "=" not in text:
        return check_compress(text)
    out = {}
    for part in text.split(","):
        pattern, sep, dtype = part.strip().rpartition("=")
        if not sep or not pattern:
            raise DataParallelError(f"{part.strip()!r} is not pattern=dtype (for example tokens.*=bf16)")
        out[pattern] = dtype
    return check_compress(out)


def describe(compress: Compress) -> str:
    """compress for a log line: 'bf16', 'none', or 'tokens.*=bf16'."""
    if isinstance(compress, Mapping):
        return ",".join(f"{p}={w or 'none'}" for p, w in compress.items())
    return compress or "none"
