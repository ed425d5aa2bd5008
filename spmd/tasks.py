"""``spmd.tasks``: the pipeline's task registry (``register``, ``get``), kept at this path for users.

The registry lives in :mod:`spmd.pipeline.tasks`.
"""

from spmd.pipeline.tasks import *  # noqa: F401,F403
from spmd.pipeline.tasks import __all__  # noqa: F401
