"""The error policy: what a backend's error in a call becomes (docs/comms.md, "Errors").

One rule, applied by :func:`converted` wherever a call runs (the call,
its description exchange, its async handle's wait and test):

- an :class:`~spmd.errors.SpmdError` raised inside goes on as it is;
- a ``RuntimeError`` (what backends raise: MPI's, gloo's and torch's
  errors all derive from it) becomes, the backend's error chained,
  a :class:`~spmd.errors.CollectiveTimeout` when the backend says it is
  its own timeout (``is_timeout``), a :class:`~spmd.errors.PeerLostError`
  when it says a peer died or hung up (``is_peer_lost``), else a
  :class:`~spmd.errors.CommunicationError`;
- any other exception (a bug, an interrupt) goes on as it is.
"""

from spmd.failfast.calls import named

__all__ = ["converted", "CONVERTED"]

#: The exceptions of a backend that the policy turns into spmd's (an SpmdError excepted).
CONVERTED = RuntimeError


def converted(backend, monitor, exc, record, waiting=False):
    """Return the spmd error that exc, a backend's error in a call (its record), stands for.

    exc is a CONVERTED exception and no SpmdError (those the caller lets go
    on); the caller raises the result ``from exc``.  backend is the
    communicator's (whose hooks say what exc is and where the peers were),
    monitor its :class:`~spmd.failfast.calls.Monitor` (which words the
    report).  waiting: exc came from the call's async handle (wait() or
    is_completed()), which the report says.
    """
    call = named(record)
    if backend.is_timeout(exc):
        from spmd.failfast.abort import stacks_report

        stacks_report()  # where every rank is at this hang, printed once by rank 0 (every backend)
        return monitor.timeout_error(backend, call, exc, backend.peers_report(call), waiting)
    lost = backend.is_peer_lost(exc)
    if lost:  # a peer that timed out may be waiting to hear where this rank was
        backend.note_stuck(call, "(a peer closed its connection)")
    return monitor.failure(backend, call, exc, lost, waiting)
