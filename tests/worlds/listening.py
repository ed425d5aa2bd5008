"""The listening TCP sockets of a process, read from /proc: for sockets.py and tests/runtime/test_sockets.py."""

import os
import socket

from spmd.runtime.network import socket_inodes


def listening(pid="self"):
    """{inode: [host, port]} of the TCP sockets pid holds that listen."""
    mine, out = socket_inodes(pid), {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{pid}/net/{name}") as table:
            next(table)
            for row in table:
                fields = row.split()
                if fields[3] != "0A" or fields[9] not in mine:
                    continue
                raw, port = fields[1].split(":")
                packed = bytes.fromhex(raw)
                packed = b"".join(packed[i:i + 4][::-1] for i in range(0, len(packed), 4))
                out[fields[9]] = [socket.inet_ntop(family, packed), int(port, 16)]
    return out


def ancestors():
    return ancestors_of(os.getpid())


def of_job(mark):
    """Every process of this host whose environment holds mark (a job's ranks, torchrun's agent): pid, its
    rank (PMI_RANK or RANK; None for a launcher's process), and the sockets it listens on, those it shares
    with a process above it (the launcher's, inherited) apart: what an outsider could read from /proc."""
    from tests.support import marked

    found = []
    for pid in sorted(marked(mark)):
        try:
            with open(f"/proc/{pid}/environ", "rb") as env:
                names = dict(v.split(b"=", 1) for v in env.read().split(b"\0") if b"=" in v)
            own = listening(pid)
            inherited = set().union(set(), *(set(listening(p)) for p in ancestors_of(pid)))
        except OSError:  # gone meanwhile
            continue
        rank = names.get(b"PMI_RANK", names.get(b"RANK"))
        if rank is None and not own:  # a shell that merely names the mark
            continue
        found.append({"pid": pid, "rank": None if rank is None else int(rank),
                      "own": sorted(a for k, a in own.items() if k not in inherited),
                      "inherited": sorted(a for k, a in own.items() if k in inherited)})
    return found


def ancestors_of(pid):
    """pid's parent, its parent and so on (six at most), below this host's PID 1."""
    seen = []
    pid = _parent(pid)
    while pid > 1 and len(seen) < 6:
        seen.append(pid)
        pid = _parent(pid)
    return seen


def _parent(pid):
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


if __name__ == "__main__":  # python -m tests.worlds.listening MARK: the job's listeners on this host, as JSON
    import json
    import sys

    print(json.dumps(of_job(sys.argv[1])))
