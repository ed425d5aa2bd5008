"""Why the ranks could not meet, in words: each cause named as what it is, with its fix."""

import errno
import socket

import pytest

from spmd.runtime.network import Address, HostCard
from spmd.runtime import said_once
from spmd.runtime.unreachable import cannot_serve, probe_store, unreached, who_failed
from spmd.errors import RendezvousError

pytestmark = pytest.mark.unit


def test_a_name_is_a_name_an_address_an_address_a_port_a_port():
    name = str(cannot_serve("vm", None, socket.gaierror(-3, "Temporary failure in name resolution")))
    assert "the name 'vm' does not resolve" in name and "port" not in name.split(".")[0]
    addr = str(cannot_serve("10.9.9.9", 29500, OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")))
    assert "10.9.9.9 is not an address of this host" in addr
    port = str(cannot_serve("127.0.0.1", 29500, OSError(errno.EADDRINUSE, "Address already in use")))
    assert "127.0.0.1:29500" in port and "in use" in port and "MASTER_PORT" in port


def test_unreached_says_loopback_refusal_route_or_silence():
    loop = unreached("127.0.1.1", 4000, None, "", "h1's name", 0.0)
    assert "loopback" in loop and "SPMD_IFNAME" in loop and "(h1's name)" in loop
    refused = unreached("198.18.0.11", 4000, errno.ECONNREFUSED, "", "", 3.0)
    assert "port 4000 refused the connection" in refused
    route = unreached("198.18.0.11", 4000, errno.EHOSTUNREACH, "No route to host", "", 3.0)
    assert "has no route to 198.18.0.11" in route
    other = unreached("198.18.0.11", 4000, errno.ETIMEDOUT, "timed out", "", 30.0)
    assert "could not join the rendezvous at 198.18.0.11:4000 within 30 s" in other


def test_who_failed_groups_ranks_by_message_and_names_hosts():
    cards = [HostCard(f"h{h}", f"h{h}/b/i", (Address("eth0", f"198.18.0.1{h}", 24),)) for h in (1, 2, 2, 3)]
    text = who_failed([(1, "refused"), (2, "refused"), (3, "no route")], cards, "198.18.0.11", 4000, 4)
    assert text.splitlines()[0] == "3 of 3 ranks could not reach rank 0's rendezvous at 198.18.0.11:4000 on h1:"
    assert "  ranks 1, 2 on h2: refused" in text and "  ranks 3 on h3: no route" in text


def test_probe_store_names_a_refusal_within_the_certain_bound(monkeypatch):
    import spmd.runtime.unreachable as unreachable

    monkeypatch.setattr(unreachable, "CERTAIN_WITHIN", 0.3)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
    with pytest.raises(RendezvousError, match=f"port {port} refused the connection"):
        probe_store("127.0.0.1", port, 5, "")


SLURM_RANK_5 = {  # srun -N4 -n8, rank 5 (tests/config/test_placement.py's SLURM_STEP)
    "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "2", "SLURM_NTASKS": "8", "SLURM_NNODES": "4",
    "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_STEP_NODELIST": "node[01-04]", "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0", "SLURMD_NODENAME": "node03"}


@pytest.mark.parametrize("given, words", [
    ("127.0.0.1", ["MASTER_ADDR=127.0.0.1 is a loopback address", "8 ranks run on 4 hosts (node01, node02",
                   "Unset MASTER_ADDR (spmd then meets at the first node, node01)"]),
    ("localhost", ["MASTER_ADDR=localhost is a loopback address"]),
    ("no-such-host.invalid", ["MASTER_ADDR='no-such-host.invalid' does not resolve"]),
])
def test_a_setting_every_rank_meets_alike_fails_at_once_and_rank_0_says_it(monkeypatch, given, words):
    """Under plain srun, across hosts: a loopback or unresolvable MASTER_ADDR is an error at once, before any
    wait, marked for rank 0 alone to say; the other ranks give rank 0 a moment first (said)."""
    from spmd.config.placement import detect
    from spmd.config.settings import Settings
    from spmd.runtime import rendezvous

    env = dict(SLURM_RANK_5, MASTER_ADDR=given)
    naps = []
    monkeypatch.setattr(rendezvous.time, "sleep", naps.append)
    with pytest.raises(RendezvousError) as caught:
        rendezvous.rendezvous(detect(env), Settings.parse(env, timeout=600), None, env)
    assert all(w in str(caught.value) for w in words), str(caught.value)
    rank, said = caught.value.everywhere
    said()
    assert rank == 5 and naps == [said_once.QUIET_GRACE]


def test_nodes_named_by_loopback_addresses_are_one_machine_where_a_loopback_rendezvous_is_no_error(monkeypatch):
    """SLURM nodes 127.0.0.2-5 (several slurmd on one machine, as bin/submit's batch file then sets
    MASTER_ADDR=127.0.0.2): every rank reaches a loopback address, so it is no error; the rendezvous goes
    on to wait for rank 0's store (stopped here where it would connect)."""
    from spmd.config.placement import detect
    from spmd.config.settings import Settings
    from spmd.runtime import rendezvous

    env = dict(SLURM_RANK_5, SLURM_STEP_NODELIST="127.0.0.[2-5]", SLURMD_NODENAME="127.0.0.4",
               MASTER_ADDR="127.0.0.2")
    placement = detect(env)
    assert placement.num_nodes > 1 and placement.hosts[0] == "127.0.0.2", placement

    class Joined(Exception):
        pass

    def joined(*args, **kwargs):
        raise Joined

    monkeypatch.setattr(rendezvous, "_meet_at", joined)
    with pytest.raises(Joined):
        rendezvous.rendezvous(placement, Settings.parse(env, timeout=600), None, env)


def test_a_host_name_that_resolves_elsewhere_is_not_loopback_as_given():
    from spmd.runtime.rendezvous import _loopback_as_given

    assert [_loopback_as_given(a) for a in ("127.0.0.1", "127.0.1.1", "::1", "LOCALHOST", "h1", "198.18.0.11")] == [
        True, True, True, True, False, False]
