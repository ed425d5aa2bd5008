"""``spmd.checkpoint``: checkpoints written atomically by the root, kept at this path for users.

The code lives in :mod:`spmd.train.checkpoint`.
"""

from spmd.train.checkpoint import *  # noqa: F401,F403
from spmd.train.checkpoint import __all__  # noqa: F401
