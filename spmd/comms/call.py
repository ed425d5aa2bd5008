"""The call path: the one place every call of a communicator runs through (docs/comms.md).

:meth:`CallPath._call` numbers a call and keeps its record (a
:class:`~spmd.failfast.calls.Call`, kept as a plain tuple), runs debug mode's cross-rank check and the trace when on, and turns
a backend's errors into spmd's by the one rule of :mod:`spmd.comms.policy`.
An async call's handle is bound to the call (:meth:`Handle.bind`), so its
wait() goes through :meth:`CallPath._waiting`.
"""

from spmd.errors import SpmdError
from spmd.failfast.calls import SEQ
from spmd.comms.policy import CONVERTED, converted

__all__ = ["CallPath"]


class CallPath:
    """_call, _describing and _waiting: a mixin of Comm (it reads ``self._mon``, the Monitor)."""

    def _call(self, hook, args, name, x=None, root=None, op=None, async_op=False, collective=True):
        """Run hook(*args) as this communicator's next call; return its result.

        The one bookkeeping path of every call, direct or general,
        collective or point to point: the sequence number and record
        (for timeout reports), debug mode's cross-rank check (collectives
        only) and the trace when on, and a backend's errors turned into
        spmd's (:func:`~spmd.comms.policy.converted`; an SpmdError raised
        inside goes on as it is).  The Handle of an async call is bound to
        the call: its wait() is bounded and converted the same way
        (:meth:`_waiting`).  For point to point, root is the peer and op the tag.
        """
        mon = self._mon
        call = mon.note(name, x, root, op)
        mon.busy = mon.seq  # the number note() just gave the call
        if not collective:
            mon.dirty = True
        try:
            result = mon.run(self, call, hook, args, x, async_op, collective) if mon.active else hook(*args)
        except SpmdError:
            raise
        except CONVERTED as exc:
            raise converted(self, exc, call) from exc
        finally:
            mon.busy = 0
        if async_op:
            result.bind(self, call)
        return result

    def _describing(self, name, x, root, fn, *args):
        """Run fn(*args), the description exchange that opens collective name, as part of it.

        The exchange is the first wait of the call, so a rank whose peers
        never come waits here: the timeout (the mpi watcher, or the torch
        backend's own) must see it, and report it under the call's number.
        """
        mon = self._mon
        call = mon.upcoming(name, x, root)
        mon.busy = call.seq
        try:
            return fn(*args)
        except SpmdError:
            raise
        except CONVERTED as exc:
            raise converted(self, exc, call) from exc
        finally:
            mon.busy, mon.pending = 0, None

    def _waiting(self, fn, call, block=True):
        """Run fn(), the wait (block) or test of the async call's handle, as part of that call.

        A wait is what the mpi watcher counts (busy is the call's number,
        and waiting its record, so the report names the call and says it was
        in wait()); either way a backend's error is converted as in the
        call itself.
        """
        mon = self._mon
        if block:
            before = mon.busy, mon.waiting
            mon.waiting, mon.busy = call, call[SEQ]
        try:
            return fn()
        except SpmdError:
            raise
        except CONVERTED as exc:
            raise converted(self, exc, call, waiting=True) from exc
        finally:
            if block:
                mon.busy, mon.waiting = before
