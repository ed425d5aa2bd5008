"""Work run in order in one thread of its own, as part of the call that submitted it.

A communicator's multi-step collectives (:mod:`spmd.comms.hierarchy`,
:mod:`spmd.comms.pipelined`) run their steps here, so an async call returns
at once and its handle waits for the job, and calls of one kind run in the
order every rank made them.  A job's error is kept and raised by whoever
waits for it, inside the call that Comm numbered.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

__all__ = ["Stages", "Job"]


class Stages:
    """One thread that runs the jobs submitted to it, in order, each job's result or error kept."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job.run()

    def submit(self, fn: Callable[[], object]) -> Job:
        """Queue fn() to run after the jobs before it; return its Job."""
        job = Job(fn)
        self._jobs.put(job)
        return job

    def stop(self, within: float = 5.0) -> None:
        """End the thread once the jobs queued before have run (waiting at most within seconds)."""
        self._jobs.put(None)
        self._thread.join(within)


class Job:
    """One submitted fn(): wait() blocks until it ran and raises its error; test() tells without blocking."""

    __slots__ = ("_fn", "_done", "_error")

    def __init__(self, fn: Callable[[], object]) -> None:
        self._fn, self._done, self._error = fn, threading.Event(), None

    def run(self) -> None:
        try:
            self._fn()
        except BaseException as exc:  # handed to the waiting thread, which raises it
            self._error = exc
        finally:
            self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error

    def test(self) -> bool:
        return self._done.is_set()
