"""Checkpoint errors and safe reading of DCP's pickled metadata: an allow-list unpickler, so a
crafted ``.metadata`` cannot run code."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from hybridpar.errors import UserError


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete, corrupt or does not fit this run."""


_ALLOWED_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_ALLOWED_GLOBALS = {
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "getattr"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),  # maps "torch.strided" to the layout object
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class _AllowListUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata but refuses any global outside DCP's own dataclasses and a few
    torch value types, so a crafted ``.metadata`` cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_ALLOWED_MODULE_PREFIXES) or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata is read with the allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        path = Path(self.path) / (".metadata" if kwargs.get("rank") is None else f"__{kwargs['rank']}.metadata")
        try:
            with open(path, "rb") as f:
                metadata = _AllowListUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
            raise CheckpointError(f"checkpoint metadata {path} is corrupt or unsafe: {e}") from None
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
