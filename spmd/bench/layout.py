"""The benchmark's cases: which collectives, which implementations, what buffers they use."""

from dataclasses import dataclass

from spmd.util.bandwidth import bus_factor

__all__ = ["COLLECTIVES", "EXTRAS", "MESSAGES", "ALL", "ROOT", "EQUAL_FORM", "BUSBW", "Layout", "Case", "impls_for"]

#: The six collectives, in table order.
COLLECTIVES = ("broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather")
#: Further measurements: uneven chunks, a list of small tensors.
EXTRAS = ("scatter_uneven", "gather_uneven", "all_reduce_many")
#: Point to point and the later collectives, asked for with --collectives: a
#: ping-pong between ranks 0 and 1 (time of the round trip), a ring sendrecv,
#: all_to_all and reduce_scatter of equal blocks.
MESSAGES = ("pingpong", "sendrecv", "all_to_all", "reduce_scatter")
ALL = COLLECTIVES + EXTRAS + MESSAGES

ROOT = 0
#: Collectives also timed in spmd's equal=True, out= form ("+equal"): same shape
#: on every rank declared, so no description exchange, and a receive buffer given.
EQUAL_FORM = ("scatter", "gather", "all_gather", "all_to_all")


#: busbw = algbw * BUSBW(collective, ranks), as nccl-tests computes it (the trace's table too).
BUSBW = bus_factor


@dataclass(frozen=True)
class Layout:
    """Element counts: per-rank chunk lengths (data movement), else one buffer's length.

    For all_reduce_many, ``elems`` is each tensor's length and ``count``
    the number of tensors.
    """

    elems: int = 0
    lengths: tuple = ()
    count: int = 1

    @property
    def nbytes(self):
        """The bytes nccl-tests calls S: one buffer, or the whole gathered array."""
        return 4 * (sum(self.lengths) if self.lengths else self.elems * self.count)


@dataclass
class Case:
    """A ready-to-time collective: ``op()`` runs it once, ``result()`` reads this rank's result."""

    op: object
    result: object
    buffer: object = None  # the data buffer, for the huge-page probe


def impls_for(collective, world_impls):
    """Return the implementations measured for collective, in table order."""
    out = []
    for name in world_impls:
        if collective.endswith("_uneven") and name == "gloo":
            continue  # torch.distributed's scatter and gather need equal sizes
        out.append(name)
        if collective == "all_reduce_many":
            out.append(name + "+coalesce")
        if collective in EQUAL_FORM and name.startswith("spmd-"):
            out.append(name + "+equal")
        if collective in ("pingpong", "sendrecv") and name == "mpi4py":
            out.append("mpi4py+pickle")  # mpi4py's own messages that carry dtype and shape
    return tuple(out)

