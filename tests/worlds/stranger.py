"""An outsider at a job's ports: python -m tests.worlds.stranger '[["HOST", PORT], ...]' MARK.

For every address at once (a thread each), as a stranger who reads the ports from /proc but knows no
secret: connect and read what the port says first; send random bytes; send the fail-fast hub's words
without the secret (``HELLO 1 <a guessed secret>`` then ``FAIL``; bare ``FAIL``, ``BYE``, ``ABORT``);
where the port opens with the job store's challenge, try its requests with a guessed secret and
before any answer (``intrude``); and, at every port, torch's own TCPStore client, as an attacker with
torch installed would: set a key of its own (outsider/MARK), read it back, and list the keys there.
Prints one JSON object per address: what each attempt got back.  tests/cluster/test_outsiders.py
(and ``intrude`` for tests/runtime/test_sockets.py).
"""

import json
import os
import random
import socket
import sys
import threading
from datetime import timedelta

GUESS = b"0123456789abcdef0123456789abcdef"
CLIENT_WITHIN = 10.0  # seconds torch's TCPStore client is given at a port


def talk(host, port, data=b"", seconds=1.0):
    """Connect, send data, and return (what the port said first or back within seconds, whether it closed)."""
    try:
        with socket.create_connection((host, port), timeout=2) as s:
            s.settimeout(seconds)
            if data:
                s.sendall(data)
            got = b""
            while len(got) < 4096:
                try:
                    chunk = s.recv(4096)
                except TimeoutError:
                    return got, False
                if not chunk:
                    return got, True
                got += chunk
            return got, False
    except OSError as exc:
        return f"error: {exc}".encode(), True


def banner(host, port):
    return talk(host, port, seconds=0.5)[0]


def intrude(host, port):
    """Try to read, write and delete keys at the job store host:port as three kinds of outsider; return
    what got through."""
    from torch.distributed import TCPStore

    from spmd.errors import RendezvousError
    from spmd.runtime.jobstore import JobStore, frames

    through = []
    guess = JobStore((host, port), GUESS, 2)
    for name, attempt in [("set", lambda: guess.set("spmd/hub", "127.0.0.1:1 evil")),
                          ("get", lambda: guess.get("spmd/hub")), ("delete", lambda: guess.delete_key("spmd/hub")),
                          ("list", lambda: guess.list_keys()), ("add", lambda: guess.add("spmd/arrived/1", 1))]:
        try:
            through.append((f"a wrong secret's {name}", attempt()))
        except RendezvousError:
            pass
    try:
        tcp = TCPStore(host, port, None, False, timedelta(seconds=2), wait_for_workers=False)
        through.append(("torch's TCPStore client", tcp.list_keys()))
    except Exception:  # noqa: BLE001 - torch raises DistStoreError or RuntimeError: refused either way
        pass
    with socket.create_connection((host, port), timeout=2) as raw:  # a request before any answer
        raw.settimeout(2)
        raw.recv(64)
        raw.sendall(frames.frame(frames.OPS["set"], b"spmd/hub", b"evil") + frames.frame(frames.OPS["list_keys"]))
        try:
            reply = raw.recv(64)
        except OSError:
            reply = b""
        if reply:
            through.append(("a request without the answer", reply))
    return through


def torch_client(host, port, mark):
    """torch's TCPStore client at host:port: what it could do (set, get back, list), or why not."""
    from torch.distributed import TCPStore

    done = {}
    try:
        store = TCPStore(host, port, None, False, timedelta(seconds=2), wait_for_workers=False)
        store.set(f"outsider/{mark}", b"evil")
        done["set"] = True
        done["get"] = store.get(f"outsider/{mark}") == b"evil"
        done["keys"] = sorted(store.list_keys())
        hub = [k for k in done["keys"] if k.endswith("spmd/hub")]  # the fail-fast hub's address and secret
        done["hub invitation"] = store.get(hub[0]).decode() if hub else None
    except Exception as exc:  # noqa: BLE001 - whatever torch raises: that attempt was refused
        done["refused"] = type(exc).__name__
    return done


def strike(host, port, mark, out):
    """Every attempt at one address; what each got back, into out (as it goes: one that never ends shows)."""
    noise = random.Random(port).randbytes(4096)
    out["address"] = [host, port]
    said = banner(host, port)
    out["banner"] = said.decode(errors="replace")
    for name, data in (("garbage", noise), ("hub hello", b"HELLO 1 " + GUESS + b"\nFAIL\n"),
                       ("bare words", b"FAIL\nBYE\nABORT\n"), ("long line", b"x" * 70000 + b"\n")):
        got, closed = talk(host, port, data)
        if got.startswith(said) and said:  # the opening line is no answer to what was sent
            got = got[len(said):]
        out[name] = {"reply": got[:200].decode(errors="replace"), "closed": closed}
    if said.startswith(b"SPMD-STORE"):
        out["store"] = [[what, repr(value)] for what, value in intrude(host, port)]
    client = {}
    trying = threading.Thread(target=lambda: client.update(torch_client(host, port, mark)), daemon=True)
    trying.start()
    trying.join(CLIENT_WITHIN)  # torch's client may wait past its own timeout
    if trying.is_alive():
        client["waiting"] = f"no answer in {CLIENT_WITHIN:g} s"
    out["torch client"] = dict(client)
    out["ended"] = True


def main(argv):
    addresses, mark = json.loads(argv[0]), argv[1]
    found = [{"address": [h, p], "ended": False} for h, p in addresses]
    threads = [threading.Thread(target=strike, args=(h, p, mark, found[i]), daemon=True)
               for i, (h, p) in enumerate(addresses)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    print("STRANGER " + json.dumps(found), flush=True)
    os._exit(0)  # not waiting for a torch client that still waits for an answer


if __name__ == "__main__":
    main(sys.argv[1:])
