"""``spmd.preempt``: checkpoint before the end (``on_preempt``), kept at this path for users.

The code lives in :mod:`spmd.runtime.preempt`.
"""

from spmd.runtime.preempt import *  # noqa: F401,F403
from spmd.runtime.preempt import __all__  # noqa: F401
