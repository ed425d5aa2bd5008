"""A store for threads and a world of threads over it, for tests of the star and what runs on it."""

import threading

from spmd.runtime.star import StoreStar


class DictStore:
    """What a StoreStar asks of a store, for threads: set, check, a wait that waits, get."""

    def __init__(self):
        self.values, self.cond = {}, threading.Condition()

    def set(self, key, value):
        with self.cond:
            self.values[key] = value.encode() if isinstance(value, str) else value
            self.cond.notify_all()

    def get(self, key):
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.values, timeout=20), f"{key} never set"
            return self.values[key]

    def check(self, keys):
        with self.cond:
            return all(k in self.values for k in keys)

    def wait(self, keys, timeout):
        with self.cond:
            if not self.cond.wait_for(lambda: all(k in self.values for k in keys), timeout=timeout.total_seconds()):
                raise RuntimeError(f"{keys} not set within {timeout}")


def ranks(size, body, store=None):
    """body(star) on one thread per rank; return each rank's result (or the exception it raised)."""
    store, out = store or DictStore(), [None] * size

    def one(r):
        try:
            out[r] = body(StoreStar(store, r, size))
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out[r] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out
