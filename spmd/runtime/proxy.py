"""The global ``comm``: a stand-in that starts the runtime on first use."""

from typing import TYPE_CHECKING, Any

from spmd.runtime.start import init, initialized, on_finalize

if TYPE_CHECKING:
    from spmd.comms.comm import Comm

__all__ = ["comm"]


class _GlobalComm:
    """Forward to the runtime's communicator, starting it on first use.

    After the first lookup of a name its value is kept on the stand-in,
    so later calls cost one attribute lookup, as on the real object;
    finalize makes it forget them.
    """

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = getattr(init(), name)
        if not name.startswith("_"):
            self.__dict__[name] = value
        return value

    def _forget(self) -> None:
        self.__dict__.clear()

    def __repr__(self) -> str:
        if not initialized():
            return "<spmd.comm (not started; starts on first use)>"
        return repr(init())


_stand_in = _GlobalComm()
on_finalize(_stand_in._forget)

if TYPE_CHECKING:
    #: The process-wide communicator (typed as what it forwards to).
    comm: Comm
else:
    comm = _stand_in
