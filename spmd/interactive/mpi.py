"""A session's world on the mpi backend: ``mpirun -n N python -m spmd.repl``, its host connecting back.

MPI's ranks must be started by MPI's launcher, so a notebook's (or
``spmd repl --backend mpi``'s) session launches them: rank 0's host
(spmd.interactive.launched) connects to the front end's loopback listener
and proves it knows the secret the launch put in its environment.  A
launched world cannot start ranks afresh, so the session launches a new
job instead (Session.restart).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time

from spmd.errors import SessionError
from spmd.interactive.handshake import FRONT, FRONT_SECRET, WITHIN, admit
from spmd.launch.forkserver.process import death_signal
from spmd.launch.supervise import STRIPPED

__all__ = ["launch"]


def _mpirun() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    found = here if os.path.exists(here) else shutil.which("mpirun")
    if found is None:
        raise SessionError("the mpi backend needs MPI's mpirun: pip install 'spmd[mpi]' (the mpich wheel; "
                           "bin/setup installs it), or use the gloo backend")
    return found


def launch(n: int) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """Start n ranks under mpirun; return the job and the connection to its host (which then says started)."""
    mpirun = _mpirun()
    listener = socket.create_server(("127.0.0.1", 0))
    secret = secrets.token_bytes(32)
    env = {k: v for k, v in os.environ.items() if k not in STRIPPED}
    env.update({"SPMD_BACKEND": "mpi", FRONT: f"127.0.0.1:{listener.getsockname()[1]}", FRONT_SECRET: secret.hex()})
    proc = subprocess.Popen([mpirun, "-n", str(n), sys.executable, "-m", "spmd.repl"], env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=death_signal(os.getpid()))
    deadline = time.monotonic() + WITHIN
    listener.settimeout(0.5)
    try:
        while time.monotonic() < deadline:
            code = proc.poll()
            if code is not None:
                raise SessionError(f"mpirun exited with status {code} before its ranks started (see its output)")
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            if admit(conn, secret) == -1:
                return proc, conn
            conn.close()
    finally:
        listener.close()
    proc.kill()
    proc.wait()
    raise SessionError(f"the {n} ranks mpirun started did not reach this session within {WITHIN:g} s")
