"""A failure of a multi-rank test shown at the user's line: spmd's own frames left out."""

from __future__ import annotations

import os
from typing import Any

from spmd.errors import SpmdError
from spmd.util.paths import is_spmd_file

__all__ = ["hide_spmd_frames"]


def hide_spmd_frames(item: Any) -> None:
    """Leave spmd's own frames out of a failure's traceback, as pytest leaves out its own.

    The error is then shown at the user's line that called spmd (an
    exception raised inside spmd keeps its innermost frame), and an spmd
    error raised from the backend's error, whose message it quotes, is
    shown without it.
    """
    original = getattr(item, "_traceback_filter", None)
    if original is None:
        return

    def hide(excinfo: Any) -> Any:
        traceback = original(excinfo)
        kept = traceback.filter(lambda entry: not _internal(str(entry.path)))
        return kept if len(kept) else traceback[-1:]

    item._traceback_filter = hide
    repr_failure = item.repr_failure

    def without_spmd_causes(excinfo: Any, *args: Any, **kwargs: Any) -> Any:
        exc = excinfo.value
        while exc is not None:  # spmd's error already quotes the backend's error it was raised from
            cause = exc.__cause__
            if cause is not None and isinstance(exc, SpmdError):
                exc.__cause__, exc.__suppress_context__ = None, True
            exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        return repr_failure(excinfo, *args, **kwargs)

    item.repr_failure = without_spmd_causes


def _internal(path: str) -> bool:
    """Whether a traceback entry is spmd's own or torch.distributed's (below spmd's calls)."""
    return is_spmd_file(path) or f"{os.sep}torch{os.sep}distributed{os.sep}" in path
