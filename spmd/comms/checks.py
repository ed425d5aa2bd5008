"""The argument checks the public methods share (docs/comms.md, "Checks").

A mixin of :class:`~spmd.comms.base.Comm`: each check raises
:class:`~spmd.errors.CollectiveError` naming the problem and the fix.
"""

import numpy as np

from spmd.errors import CollectiveError
from spmd.comms.arrays import check_array, dtype_name

__all__ = ["Checks"]


class Checks:
    """_root, _array, _check_out and the helpers they use (self.size, self._check_device)."""

    def _root(self, root):
        """Return root when it is a rank of this communicator, else raise."""
        if type(root) is int and 0 <= root < self.size:
            return root
        if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < self.size:
            raise CollectiveError(
                f"root {root!r} is out of range: this communicator has ranks 0 to {self.size - 1}"
            )
        return int(root)

    def _array(self, x, what="x"):
        check_array(x, what)
        self._check_device(x, what)
        return x

    @staticmethod
    def _kind_dtype(x):
        return ("numpy" if isinstance(x, np.ndarray) else "torch"), dtype_name(x)

    def _check_out(self, out, kind, dtype, shape, what):
        """Raise unless out can receive an array of this kind, dtype and shape."""
        got_kind, got_dtype = self._kind_dtype(out)
        contiguous = out.flags.c_contiguous if isinstance(out, np.ndarray) else out.is_contiguous()
        if (got_kind, got_dtype, tuple(out.shape)) != (kind, dtype, tuple(shape)) or not contiguous:
            raise CollectiveError(
                f"{what}: out must be a contiguous {kind} array of dtype {dtype} and shape "
                f"{tuple(shape)}, got a {'contiguous' if contiguous else 'non-contiguous'} "
                f"{got_kind} {got_dtype} array of shape {tuple(out.shape)}"
            )

    @staticmethod
    def _split(x, sizes):
        """Cut x along dim 0 into views of the given lengths."""
        out, start = [], 0
        for n in sizes:
            out.append(x[start : start + n])
            start += n
        return out
