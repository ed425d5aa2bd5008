"""The rendezvous store spmd serves itself: torch.distributed's Store, for members of the job only.

torch's TCPStore accepts anyone who can reach its port.  This one is the
same key-value store (set, get, add, wait, ...) served by a thread in rank 0
on a socket bound to one interface, and a connection counts only once it has
answered a challenge with the job's secret (``spmd.runtime.secret``): an
outsider can neither read nor change a key.  ``frames``: the requests and
answers; ``keeper``: rank 0's keys and thread (an ``spmd.util.authserver``);
``client``: the ``dist.Store`` every rank hands to torch.  docs/reliability.md, "Sockets and strangers".
"""

from spmd.runtime.jobstore.client import JobStore
from spmd.runtime.jobstore.keeper import StoreServer, bind

__all__ = ["JobStore", "StoreServer", "bind"]
