"""Which dtype each gradient travels in: ``compress`` as one name for every gradient, or per parameter.

``DataParallel(compress=...)`` takes None, "fp16" or "bf16" (every gradient),
or a mapping of parameter-name patterns (``fnmatch``, as in
``model.named_parameters()``) to one of those: ``{"tokens.*": "bf16"}``
compresses the token embedding and sends the rest as it is.  The first
pattern that matches a name decides.  ``parse_compress`` reads the command
line's form, ``tokens.*=bf16,mlm.*=fp16``.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Union

from spmd.errors import DataParallelError
from spmd.train.buckets import COMPRESS

if TYPE_CHECKING:
    from torch import nn

__all__ = ["Compress", "check_compress", "dtype_names", "parse_compress", "describe"]

#: What ``compress`` accepts: one dtype name for every gradient, or patterns -> names.
Compress = Union[str, None, Mapping[str, Union[str, None]]]

_NAMES = "None, 'none', 'fp16' or 'bf16'"


def check_compress(compress: Compress) -> str | None | dict[str, str | None]:
    """Return compress in one form (None for 'none'), or raise DataParallelError naming what is wrong."""
    if isinstance(compress, Mapping):
        out = {}
        for pattern, dtype in compress.items():
            if not isinstance(pattern, str) or not pattern:
                raise DataParallelError(f"compress: a pattern must be a non-empty string, got {pattern!r}")
            if dtype not in COMPRESS:
                raise DataParallelError(f"compress: {pattern!r} maps to {dtype!r}; use {_NAMES}")
            out[pattern] = None if dtype == "none" else dtype
        return out
    if compress not in COMPRESS:
        raise DataParallelError(
            f"compress must be one of {_NAMES}, or a mapping of parameter-name patterns to those "
            f"(for example {{'tokens.*': 'bf16'}}); got {compress!r}")
    return None if compress == "none" else compress


def dtype_names(model: nn.Module, compress: Compress) -> dict[int, str | None]:
    """{id(parameter): the name of the dtype its gradient travels in, or None} of the trainable parameters.

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
    """Read the command line's --compress: 'none', 'fp16', 'bf16', or 'pattern=dtype,pattern=dtype'."""
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
