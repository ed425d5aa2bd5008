"""Scatter, process, gather: :func:`pipeline` applies a per-record function to a table on every rank.

The API lives in :mod:`spmd.pipeline.run`; docs/pipeline.md says what each module does.
"""

from spmd.pipeline.run import *  # noqa: F401,F403  (the public API, spmd.pipeline.pipeline)
from spmd.pipeline.run import __all__  # noqa: F401
