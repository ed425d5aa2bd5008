"""Point to point in debug mode: call sites and verdicts travel with the messages.

A mixin of :class:`~spmd.comms.p2p.methods.PointToPoint`.  With
``SPMD_DEBUG=1`` a sender also sends its call site, and the sender of a
blocking send of over 64 KiB waits for the receiver's verdict, so both
ranks raise a mismatch (docs/comms.md, "Point to point").
"""

import numpy as np

from spmd.errors import CollectiveError
from spmd.comms.handle import Handle
from spmd.comms.p2p.incoming import DATA, HEADER, VERDICT, WHERE, all_done
from spmd.comms.p2p.plan import VERDICT_AFTER, Finished

__all__ = ["CheckedMessages"]


class CheckedMessages:
    """_send_checked, and the small text messages (_send_bytes, _recv_bytes) debug mode adds."""

    def _send_checked(self, c, header, dst, base, async_op, n, inline):
        """Debug mode: send the header (inline data included) and the call site, then the data.

        A blocking send of more than VERDICT_AFTER bytes, which waits for the
        receiver in any MPI, first waits for the receiver's verdict and sends
        its data only if the receiver agrees: both ranks then raise a
        mismatch.  Any other send (inline, eager-sized or immediate) goes on
        without it, so debug mode never adds a wait that could deadlock a ring
        of sends; the receiver raises the mismatch, naming both call sites,
        and drains the data.
        """
        from spmd.failfast.calls import caller

        waits = not async_op and n > VERDICT_AFTER
        self._send(self._packed(header, c, n) if inline else header, dst, base + HEADER, False)
        self._send_bytes(("1" if waits else "0") + caller(), dst, base + WHERE)
        if waits:
            verdict = self._recv_bytes(dst, base + VERDICT)
            if verdict:
                raise CollectiveError(verdict)
        if n and not inline:
            if async_op:
                work = self._send(c, dst, base + DATA, True)
                return Handle(lambda: self._progressing([work]), lambda: all_done([work]), lambda: (c, None)[1])
            self._send(c, dst, base + DATA, False)
        return Finished(None) if async_op else None

    def _send_bytes(self, text, dst, tag):
        """Send a small text message (debug mode's call sites and verdicts): its length, then its bytes."""
        data = np.frombuffer(text.encode(), np.uint8)
        self._send(np.array([data.nbytes], np.int64), dst, tag, False)
        if data.nbytes:
            self._send(data, dst, tag, False)

    def _recv_bytes(self, src, tag):
        """Receive a small text message (debug mode's call sites and verdicts)."""
        size = np.empty(1, np.int64)
        self._recv(size, src, tag, False)
        data = np.empty(int(size[0]), np.uint8)
        if data.nbytes:
            self._recv(data, src, tag, False)
        return data.tobytes().decode()
