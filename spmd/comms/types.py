"""Types shared by the communicator's annotations (docs/comms.md).

``ArrayT`` is an array a call hands back as it was given: a numpy array
or a torch tensor.  ``Array`` is either, where nothing ties a result to an
argument.  Neither module is imported at run time: ``import spmd`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar, Union

if TYPE_CHECKING:
    import numpy
    import torch

__all__ = ["ArrayT", "Array", "Op", "Obj"]

#: A numpy array or a torch tensor, the same one in and out.
ArrayT = TypeVar("ArrayT", "numpy.ndarray", "torch.Tensor")
#: A numpy array or a torch tensor.
Array = Union["numpy.ndarray", "torch.Tensor"]
#: A reduction: "sum", "prod", "min", "max" or "avg".
Op = str
#: Any picklable object (the object collectives and send_object).
Obj = Any
