"""The hardware profile's file (``hybridpar calibrate`` writes it, ``hybridpar plan --gpu FILE``
and ``train --parallel.auto`` read it): where it lives, how it is written, and the cores a CPU
profile is measured on. No torch (:mod:`hybridpar.planner.machine.calibrate` measures), so
``hybridpar plan`` and the run fit (``plan --from-run``) need not import it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from hybridpar.fsutil import cache_root


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. under taskset), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_profile_path() -> Path:
    """Where ``calibrate`` writes and ``train --parallel.auto`` looks: ``$HYBRIDPAR_CACHE`` (else
    ``$XDG_CACHE_HOME/hybridpar``, else ``~/.cache/hybridpar``) ``/hardware.toml``."""
    return cache_root() / "hardware.toml"


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"cannot write {v} to a profile")
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to a profile")


def to_toml(gpu: dict[str, object], calibration: dict[str, object], comm: list[dict[str, object]],
            header: str) -> str:
    """The profile text: ``[gpu]``, ``[calibration]`` and ``[[calibration.comm]]`` tables."""
    lines = [f"# {line}" for line in header.splitlines()] + ["", "[gpu]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in gpu.items()]
    lines += ["", "[calibration]"]
    for k, v in calibration.items():
        if isinstance(v, list) and v and isinstance(v[0], list):
            lines.append(f"{k} = [")
            lines += [f"  {_toml_value(row)}," for row in v]
            lines.append("]")
        else:
            lines.append(f"{k} = {_toml_value(v)}")
    for fit in comm:
        lines += ["", "[[calibration.comm]]"] + [f"{k} = {_toml_value(v)}" for k, v in fit.items()]
    return "\n".join(lines) + "\n"
