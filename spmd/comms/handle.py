"""Handles of collectives in flight: ``wait()`` gives the result."""

__all__ = ["Handle", "Done"]


class Handle:
    """A collective in flight; ``wait()`` returns its result.

    Until ``wait()`` returns, the arrays given to the call (and ``out=``)
    belong to the backend: neither read nor write them.

    A handle that a public method returned is its call's: ``wait()`` is
    bounded by the communicator's timeout like a blocking call, and raises
    spmd's errors naming the call (``CollectiveTimeout``,
    ``PeerLostError``, ``CommunicationError``), never the backend's own.
    """

    __slots__ = ("_wait", "_test", "_finish", "_done", "_result", "_owner", "_fp")

    def __init__(self, wait, test, finish):
        """wait() blocks until the work is done, test() tells without blocking, finish() gives the result."""
        self._wait, self._test, self._finish = wait, test, finish
        self._done, self._result = False, None
        # The communicator and fingerprint of the call that returned this handle (Comm._call sets them).
        self._owner = self._fp = None

    def wait(self):
        """Block until the collective is complete and return its result."""
        if not self._done:
            if self._owner is None:
                self._wait()
            else:
                self._owner._waiting(self._wait, self._fp)
            self._done = True
            self._result = self._finish()
        return self._result

    def is_completed(self):
        """Tell, without blocking, whether the collective has completed."""
        if not self._done:
            if self._owner is None:
                done = self._test()
            else:
                done = self._owner._waiting(self._test, self._fp, block=False)
            if done:
                self.wait()
        return self._done

    def __repr__(self):
        return f"<Handle {'done' if self._done else 'pending'}>"


class Done(Handle):
    """A handle for work that finished before it was returned."""

    __slots__ = ()

    def __init__(self, result):
        self._done, self._result, self._owner = True, result, None


def after(works, finish, async_op):
    """Wait for every work of a list (objects with wait() and is_completed()), or hand back a handle."""
    if async_op:
        return Handle(
            lambda: [w.wait() for w in works],
            lambda: all(w.is_completed() for w in works),
            finish,
        )
    for w in works:
        w.wait()
    return finish()
