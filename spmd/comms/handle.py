"""Handles of calls in flight: ``wait()`` gives the result (docs/comms.md)."""

from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

__all__ = ["Handle", "Done"]

#: What a handle's wait() gives: the array, list or sender's rank of its call.
R = TypeVar("R")


class Handle(Generic[R]):
    """A collective in flight; ``wait()`` returns its result.

    Until ``wait()`` returns, the arrays given to the call (and ``out=``)
    belong to the backend: neither read nor write them.

    A handle that a public method returned is its call's: ``wait()`` is
    bounded by the communicator's timeout like a blocking call, and raises
    spmd's errors naming the call (``CollectiveTimeout``,
    ``PeerLostError``, ``CommunicationError``), never the backend's own.
    """

    __slots__ = ("_wait", "_test", "_finish", "_done", "_result", "_owner", "_call")

    def __init__(self, wait: Callable[[], Any], test: Callable[[], bool], finish: Callable[[], R]) -> None:
        """wait() blocks until the work is done, test() tells without blocking, finish() gives the result."""
        self._wait, self._test, self._finish = wait, test, finish
        self._done = False
        self._result: R | None = None
        # The communicator and the record of the call this handle belongs to (bind()), else None.
        self._owner: Any = None
        self._call: tuple[Any, ...] | None = None

    def bind(self, owner: Any, call: tuple[Any, ...]) -> None:
        """Make this handle the call's (its record, as Monitor.note gave it) on communicator owner.

        wait() and is_completed() then run as part of that call
        (``owner._waiting``): bounded by its timeout, errors turned into spmd's.
        A handle already done has nothing left to bound.
        """
        if not self._done:
            self._owner, self._call = owner, call

    def on_complete(self, fn: Callable[[], object]) -> None:
        """Run fn() once the work is complete, just before wait() makes the result.

        The trace times an async call with it, an immediate receive notes
        its sender; a hook added later runs before those added earlier.
        """
        finish = self._finish

        def finishing() -> R:
            fn()
            return finish()

        self._finish = finishing

    def wait(self) -> R:
        """Block until the collective is complete and return its result."""
        if not self._done:
            if self._owner is None:
                self._wait()
            else:
                self._owner._waiting(self._wait, self._call)
            self._done = True
            self._result = self._finish()
        return self._result  # type: ignore[return-value]  # set once done

    def is_completed(self) -> bool:
        """Tell, without blocking, whether the collective has completed."""
        if not self._done:
            if self._owner is None:
                done = self._test()
            else:
                done = self._owner._waiting(self._test, self._call, block=False)
            if done:
                self.wait()
        return self._done

    def __repr__(self) -> str:
        return f"<Handle {'done' if self._done else 'pending'}>"


class Done(Handle[R]):
    """A handle for work that finished before it was returned."""

    __slots__ = ()

    def __init__(self, result: R) -> None:
        self._done, self._result, self._owner = True, result, None


def after(works: list[Any], finish: Callable[[], Any], async_op: bool) -> Any:
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
