"""Per-cluster defaults for ``spmd submit``, from TOML profiles.

Read, the later overriding the earlier: ``$XDG_CONFIG_HOME/spmd/submit.toml``
(default ``~/.config/spmd/submit.toml``), then the project's ``spmd-submit.toml``,
the first found from the working directory upward.  Each holds ``[profile.NAME]``
tables keyed by ``spmd submit``'s long option names; command-line options
override them; ``env`` merges by name; ``setup`` and ``sbatch-options`` add up.
The format and an example: docs/slurm.md ("Profiles").
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Mapping

from spmd.submit.options import SubmitError, check

__all__ = ["PROJECT_FILE", "user_file", "project_file", "config_files", "load", "merge"]

PROJECT_FILE = "spmd-submit.toml"
_ADDITIVE = ("setup", "sbatch_options")
_NOT_IN_PROFILES = ("script", "args")


def user_file(environ: Mapping[str, str] | None = None) -> Path:
    """Return the path of the user's profile file (it may not exist)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CONFIG_HOME") or os.path.join(env.get("HOME") or "~", ".config")
    return Path(os.path.expanduser(base)) / "spmd" / "submit.toml"


def project_file(start: Path | str | None = None) -> Path | None:
    """Return the nearest spmd-submit.toml from start (default: cwd) upward, or None."""
    here = Path(start or os.getcwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / PROJECT_FILE
        if candidate.is_file():
            return candidate
    return None


def config_files(start=None, environ=None) -> list[Path]:
    """Return the profile files that exist, lowest precedence first."""
    files = [user_file(environ), project_file(start)]
    return [f for f in files if f is not None and f.is_file()]


def _read(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, ValueError) as exc:  # TOMLDecodeError is a ValueError
        raise SubmitError(f"cannot read {path}: {exc}") from None
    unknown = sorted(set(data) - {"profile"})
    if unknown:
        raise SubmitError(f"{path}: unknown table or key {', '.join(unknown)}; profiles go in "
                          "[profile.NAME] tables")
    profiles = data.get("profile", {})
    if not isinstance(profiles, dict) or not all(isinstance(v, dict) for v in profiles.values()):
        raise SubmitError(f"{path}: 'profile' must hold tables, like [profile.NAME]")
    return profiles


def _checked(path, name, table) -> dict:
    out = {}
    for key, value in table.items():
        option = key.replace("-", "_")
        where = f"{path} [profile.{name}]"
        if option in _NOT_IN_PROFILES:
            raise SubmitError(f"{where}: {key!r} cannot be set in a profile; give it on the "
                              "command line")
        try:
            out[option] = check(option, value)
        except SubmitError as exc:
            raise SubmitError(f"{where}: {exc}") from None
    return out


def merge(*layers: Mapping) -> dict:
    """Merge option mappings, later ones winning; env merges by name, lists add up."""
    out: dict = {}
    for layer in layers:
        for key, value in layer.items():
            if value is None:
                continue
            if key == "env":
                out["env"] = tuple({**dict(out.get("env", ())), **dict(value)}.items())
            elif key in _ADDITIVE:
                out[key] = tuple(out.get(key, ())) + tuple(value)
            else:
                out[key] = value
    return out


def load(name: str | None = None, files: list[Path] | None = None) -> tuple[dict, list[str]]:
    """Return (options, sources) of profile name (None: 'default' if any file has it).

    Raise SubmitError when a named profile is in no file, or a value is invalid.
    """
    files = config_files() if files is None else files
    wanted = name or "default"
    layers, sources, seen = [], [], set()
    for path in files:
        profiles = _read(Path(path))
        seen.update(profiles)
        if wanted in profiles:
            layers.append(_checked(path, wanted, profiles[wanted]))
            sources.append(f"{path} [profile.{wanted}]")
    if name and not layers:
        where = ", ".join(map(str, files)) or f"no file ({user_file()} or ./{PROJECT_FILE})"
        known = ", ".join(sorted(seen)) or "none"
        raise SubmitError(f"no profile {name!r} in {where}; profiles found: {known}")
    return merge(*layers), sources
