"""The process groups of a split, made on every rank in the same order, kept only when every rank's worked.

torch.distributed requires every rank to create every new group, in the
same order (its names count the groups made).  Making a gloo group opens
and connects a fresh socket to each member, and that connection can fail
on one rank for a reason of the moment ("Connection closed by peer" seen
here when another group between the same processes had just closed).  A
rank that raised alone would leave the others holding a group it lacks,
so the ranks say to each other whether theirs worked, on the store (a
rank whose partner failed early waits at its connect until the timeout,
longer than a collective of the parent would wait), and a failure
anywhere makes every rank drop what it made and try again, up to
ATTEMPTS times; then every rank raises with each rank's first error.
"""

import sys
import time
from datetime import timedelta

import torch.distributed as dist

from spmd.errors import CommunicationError
from spmd.failfast.calls import first_line

__all__ = ["ATTEMPTS", "make_groups"]

#: How many times the ranks try to make a split's groups before they give up.
ATTEMPTS = 3


def _make(groups, timeout):
    """Every group in order; this rank's made group (or None), and its error as text."""
    mine, error = None, None
    for ranks in groups:
        try:
            group = dist.new_group(ranks, timeout=timedelta(seconds=timeout), sort_ranks=False)
        except (RuntimeError, dist.DistError) as exc:  # the others are still made, so the names stay in step
            error = f"{type(exc).__name__}: {first_line(exc)}"
            continue
        if group not in (None, dist.GroupMember.NON_GROUP_MEMBER):
            mine = group
    return mine, error


def _outcomes(parent, store, tag, error, timeout):
    """Every rank's error (None where its groups were made), in parent's rank order."""
    if store is None:  # torch's mpi backend: no store, and no sockets of its own to fail
        return parent.all_gather_object(error)
    store.set(f"{tag}/{parent.rank}", (error or "").encode())
    keys = [f"{tag}/{r}" for r in range(parent.size)]
    usual = store.timeout
    store.set_timeout(timedelta(seconds=2 * timeout))
    try:  # one request, answered when the last rank has said: no rank reads the store after another left
        said = store.multi_get(keys)
    except (RuntimeError, dist.DistError) as exc:
        raise CommunicationError(
            f"rank {parent.rank}: split did not learn within {2 * timeout:g} s whether the other ranks' "
            f"communicators connected ({exc}); a rank may have died") from None
    finally:
        store.set_timeout(usual)
    return [value.decode() or None for value in said]


def make_groups(parent, store, tag, groups, timeout):
    """Make groups (lists of global ranks) on every rank of parent; return this rank's group or None.

    Every rank of parent passes the same tag (unique to this split), the
    same groups, and the job's store (None: the outcomes go over parent).
    """
    errors = []
    for attempt in range(1, ATTEMPTS + 1):
        mine, error = _make(groups, timeout)
        errors = _outcomes(parent, store, f"spmd/split/{tag}/{attempt}", error, timeout)
        if not any(errors):
            return mine
        if mine is not None:
            dist.destroy_process_group(mine)
        if parent.rank == 0 and attempt < ATTEMPTS:
            said = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
            print(f"spmd: connecting a split's communicators failed ({said}); every rank tries again "
                  f"(attempt {attempt + 1} of {ATTEMPTS})", file=sys.stderr, flush=True)
        time.sleep(0.05 * attempt)
    said = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
    raise CommunicationError(
        f"split could not connect its communicators in {ATTEMPTS} attempts ({said}); check that the "
        "ranks can reach each other (GLOO_SOCKET_IFNAME names the interface gloo uses)")
