"""How long the hub's heartbeat waits while the main thread computes: beat_gaps.py [SECONDS].

Rank 0's hub and one rank's client run in this one process, beating every 2 s (the default), so both
threads compete for the GIL with the main thread, which runs each kind of compute for SECONDS (8) in
turn.  Printed per kind: the longest gap between two beats the hub heard, against the 10 s after which
it would end the job.  A C call that never releases the GIL (the last kind) is the one way to starve
them: it is what the heartbeat's cost in docs/reliability.md ("Host faults") warns of.
"""

import sys
import time

import numpy as np

from spmd.failfast.hub import base, open_hub
from spmd.failfast.hub.judge import MISSES

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 8.0
BEAT = 2.0
heard = []
base.exit_now = lambda code, message=None: print(f"WOULD END: {message}", flush=True)


def python_loop(end):
    total = 0
    while time.monotonic() < end:
        total += sum(i * i for i in range(10_000))


def numpy_big(end):
    a = np.random.default_rng(0).random((1500, 1500))
    while time.monotonic() < end:
        a = np.tanh(a @ a / 1500.0)


def numpy_small(end):
    a = np.random.default_rng(0).random((32, 32))
    while time.monotonic() < end:
        a = np.tanh(a @ a / 32.0)


def torch_ops(end):
    import torch

    a = torch.rand(1500, 1500)
    while time.monotonic() < end:
        a = torch.tanh(a @ a / 1500.0)


def one_c_call(end):
    n = 10_000_000
    began = time.monotonic()
    sum(range(n))  # calibrate: builtins.sum over a range holds the GIL throughout
    per = (time.monotonic() - began) / n
    sum(range(int(max(0.0, end - time.monotonic()) / per)))


shared = []
hub = open_hub(0, 2, lambda v: shared.append(v) or v, True, 5, name="here", beat=BEAT)
received = hub._received


def _received(conn, data):
    heard.append(time.monotonic())
    received(conn, data)


hub._received = _received
client = open_hub(1, 2, lambda _: shared[0], True, 5, name="here", beat=BEAT)
time.sleep(0.5)
print(f"beat {BEAT:g} s, silence declared after {BEAT * MISSES:g} s")
for work in (python_loop, numpy_big, numpy_small, torch_ops, one_c_call):
    heard.clear()
    began = time.monotonic()
    work(began + SECONDS)
    time.sleep(BEAT + 0.5)  # the beat after the work, so a gap the work caused is seen
    times = [began] + heard
    gap = max(b - a for a, b in zip(times, times[1:]))
    print(f"{work.__name__:<12} longest gap between beats {gap:5.2f} s", flush=True)
client.close()
hub.close()
