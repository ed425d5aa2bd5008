"""Collective timeouts on MPI, which cannot interrupt a call: a thread watches the call in progress.

Past the timeout it asks for the report of where every rank is, prints
which call this rank waits in and aborts the job (docs/reliability.md,
"Error semantics" and "Every rank's stack at a hang").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from spmd.failfast.abort import abort_job, report_message, stacks_report
from spmd.failfast.calls import SEQ, timed_out

__all__ = ["MpiTimeout"]


class MpiTimeout:
    """Abort the job when an MPI call, or the wait() of an async one, has waited past the timeout.

    A monitor's ``busy`` is the number of the call its rank blocks in (set
    by ``Comm._call``, and by a handle's ``wait()``, which also sets
    ``waiting``); the same number seen for longer than the timeout ends the job.
    """

    def __init__(self, comm: Any, monitors: Sequence[Any]) -> None:
        # Not the communicator itself: this thread must never hold the last
        # reference to it, or the communicator's tensors are freed on this
        # thread, which aborts the process if that happens during interpreter
        # teardown ("terminate called without an active exception").
        self.rank, self.size, self.timeout = comm.rank, comm.size, comm.timeout
        self._monitors = monitors  # the world's monitor and its sub-communicators'
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spmd-timeout", daemon=True)
        self._thread.start()

    def _run(self):
        timeout = self.timeout
        period = min(1.0, timeout / 4)
        since = {}
        while not self._stop.wait(period):
            now = time.monotonic()
            for mon in list(self._monitors):
                busy, waiting = mon.busy, mon.waiting
                if not busy:
                    since.pop(id(mon), None)
                    continue
                first = since.get(id(mon))
                if first is None or first[0] != busy:
                    since[id(mon)] = (busy, now)
                elif now - first[1] > timeout:
                    in_wait = waiting is not None and waiting[SEQ] == busy
                    call = mon.find(busy)  # (an async call's wait: found though out of the ring)
                    name = mon.name_of(call) if call else "a collective"
                    self._expire(mon, busy, name, in_wait)

    def _expire(self, mon, seq, name, in_wait=False):
        # Where every rank is, gathered by the hub while the ranks still wait (rank 0 prints it).
        where = "see the report of every rank's stack" if stacks_report() else "where the others wait cannot be known"
        peers = "its peer" if name.startswith(("send ", "recv ")) else "the other ranks"
        message = (
            timed_out(f"### spmd: rank {self.rank} of {self.size}", f"{name} (call #{seq})", self.timeout,
                      peers, in_wait)
            + f" (mpi backend; {where}). Last calls on this rank: {mon.recent()}. Ending the job."
        )
        # One report per job: a rank whose timeout a lower rank reports alike prints one line.
        abort_job(1, after=report_message(message))  # MPI_Abort, once mpirun has had a moment to forward it

    def close(self) -> None:
        """Stop watching (the thread wakes at once)."""
        self._stop.set()
        self._thread.join(timeout=5.0)  # it wakes at once; ended before the interpreter
