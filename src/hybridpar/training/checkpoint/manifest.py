"""``complete.json``, the manifest a checkpoint is whole by: written last (size and sha256 of every
other file), read and checked field by field before anything loads; and the run's ``config.json``.

A directory with a valid ``complete.json`` whose listed files are all there at their sizes is a
checkpoint; ``deep`` checks also compare every checksum and read DCP's metadata through the
allow-list unpickler.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hybridpar.config import Config, ConfigError, config_from_dict
from hybridpar.training.checkpoint.durable import sha256, write_durable
from hybridpar.training.checkpoint.safe_metadata import CheckpointError, SafeReader

COMPLETE = "complete.json"
FORMAT = 1


def is_complete(path: Path) -> bool:
    """Whether ``path`` has a ``complete.json`` (written last: the save finished)."""
    return (Path(path) / COMPLETE).is_file()


def write_complete(folder: Path, step: int, world_size: int) -> None:
    """Write and fsync ``folder``'s ``complete.json``: step, format, time, world size and the
    size and sha256 of every other file in it (DCP's shards and metadata, config, tokenizer)."""
    files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256(f)}
             for f in sorted(Path(folder).iterdir()) if f.is_file() and f.name != COMPLETE}
    write_durable(Path(folder) / COMPLETE, json.dumps({"step": step, "format": FORMAT, "time": time.time(),
                                                       "world_size": world_size, "files": files}, indent=1) + "\n")


def problem(path: Path, deep: bool) -> str | None:
    """Why ``path`` is not a whole checkpoint, as the rest of a sentence that starts with
    "checkpoint " (None: it is whole): a valid ``complete.json``, the metadata, and every file of
    its manifest at its size; ``deep`` also reads the metadata through the safe unpickler and
    compares every checksum."""
    if not path.is_dir():
        return f"{path} does not exist"
    if not is_complete(path):
        return f"{path} is incomplete (no {COMPLETE}); it was interrupted while saving"
    info, why = _info(path)
    if why is not None:
        return why
    if not (path / ".metadata").is_file():
        return f"{path} has no .metadata; it is not a complete hybridpar checkpoint"
    if deep:
        try:
            SafeReader(str(path)).read_metadata()  # refuse unsafe or corrupt metadata before DCP wraps the error
        except CheckpointError as e:
            return str(e).removeprefix("checkpoint ")
    for name, entry in info.get("files", {}).items():
        f = path / name
        if not f.is_file():
            return f"{path} is missing {name}; it was damaged after saving"
        size = f.stat().st_size
        if size != entry["bytes"]:
            return (f"file {f} does not match its checksum in {COMPLETE} ({size} bytes, expected "
                    f"{entry['bytes']}); it is corrupt")
        if deep and sha256(f) != entry["sha256"]:
            return (f"file {f} does not match its checksum in {COMPLETE} (the size is right, {size} bytes, "
                    "the sha256 differs); it is corrupt")
    return None


def _info_problem(info: Any) -> str | None:
    """What is wrong with a parsed ``complete.json`` (None: nothing)."""
    if not isinstance(info, dict):
        return "is not a JSON object"
    if "step" not in info:
        return "has no 'step'"
    step = info["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"has step = {json.dumps(step)}, not a step number >= 0"
    if "format" in info and info["format"] != FORMAT:
        return f"has format = {json.dumps(info['format'])}; this hybridpar reads format {FORMAT}"
    files = info.get("files", {})
    if not isinstance(files, dict):
        return "has a 'files' manifest that is not an object"
    for name, entry in files.items():
        ok = (isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)
              and name not in ("", ".", "..") and "/" not in name and "\\" not in name)
        if not ok:
            return f"has a malformed 'files' entry {json.dumps(name)}"
    return None


def _info(path: Path) -> tuple[dict[str, Any], str | None]:
    """``complete.json`` of ``path`` and, if it is unusable, why (a "checkpoint ..." sentence tail)."""
    try:
        info = json.loads((Path(path) / COMPLETE).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        return {}, f"{path}: unreadable {COMPLETE} ({e})"
    why = _info_problem(info)
    if why is not None:
        return {}, f"{path}: {COMPLETE} {why}; it was not written by hybridpar or was edited"
    return info, None


def read_info(path: Path) -> dict[str, Any]:
    """The completion record (step, format, time, manifest) of a complete checkpoint, checked
    field by field before anything is loaded."""
    info, why = _info(path)
    if why is not None:
        raise CheckpointError(f"checkpoint {why}")
    return info


def read_config(path: Path) -> Config:
    """The run's config saved with a checkpoint (``config.json``), validated as any config is."""
    try:
        return config_from_dict(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable config.json ({e})") from None
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {path}: config.json is invalid: {e}") from None
