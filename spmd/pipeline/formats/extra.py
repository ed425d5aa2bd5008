"""Import a format's library, or say which extra installs it."""

from __future__ import annotations

import importlib
import threading
from types import ModuleType

from spmd.errors import MissingExtraError

__all__ = ["need", "warm", "PACKAGES"]

#: The PyPI package that provides each module the formats import.
PACKAGES = {"pyarrow": "pyarrow", "pyarrow.parquet": "pyarrow", "h5py": "h5py", "zarr": "zarr"}


def need(module: str, purpose: str) -> ModuleType:
    """Return the imported module, or raise MissingExtraError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = PACKAGES.get(module, module.split(".")[0])
        raise MissingExtraError(
            f"{purpose} needs the {package} package, which cannot be imported here ({exc}): "
            f"pip install 'spmd[formats]' (bin/setup installs it) on every host the job runs on") from None


def warm(modules: list[str], wait: bool = False) -> None:
    """Import modules early (a format library takes 0.2-0.5 s), in a thread, or here with wait: a rank that
    would import one only after rank 0 opened the input does it meanwhile.  A missing one is said later,
    by need."""
    def load() -> None:
        for module in modules:
            try:
                importlib.import_module(module)
            except Exception:
                pass

    if wait:
        load()
    elif modules:
        threading.Thread(target=load, name="spmd-pipeline-imports", daemon=True).start()
