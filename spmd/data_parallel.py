"""``spmd.data_parallel``: DataParallel and its helpers, kept at this path for users.

The code lives in :mod:`spmd.train`.
"""

from spmd.train.data_parallel import *  # noqa: F401,F403
from spmd.train.data_parallel import __all__  # noqa: F401
