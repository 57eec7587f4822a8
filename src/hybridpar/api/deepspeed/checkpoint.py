"""``save_checkpoint`` / ``load_checkpoint`` of the DeepSpeed front door.

Layout as DeepSpeed's: ``<dir>/<tag>/`` per checkpoint and ``<dir>/latest`` holding the newest
tag. Each ``<tag>`` is a :meth:`~hybridpar.api.engine.ModelEngine.save` checkpoint (the
reshardable ``torch.distributed.checkpoint`` format, written atomically), so it loads at any dp
size, ZeRO stage and world size; ``client_state.pt`` in it holds the client state and a client LR
scheduler's state (``torch.save``; read back with ``weights_only=True``: plain containers,
numbers, strings and tensors). DeepSpeed's own files (``mp_rank_00_model_states.pt``,
``zero_pp_rank_*``) are refused, naming ``zero_to_fp32.py``, the converter DeepSpeed writes next to them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridpar.training.checkpoint import CheckpointError
from hybridpar.training.metrics import atomic_write_text

if TYPE_CHECKING:
    from hybridpar.api.deepspeed.engine import DeepSpeedEngine

__all__ = ["load", "save"]

LATEST = "latest"
CLIENT = "client_state.pt"
DEEPSPEED_FILES = ("mp_rank_*_model_states.pt", "zero_pp_rank_*", "*_optim_states.pt", "bf16_zero_pp_rank_*",
                   "layer_*-model_states.pt")
WAY_OUT = ("convert it with DeepSpeed's zero_to_fp32.py (written next to its checkpoints) into a state dict, "
           "load that into the model before initialize(), and save again with save_checkpoint")


def save(engine: DeepSpeedEngine, save_dir: str | os.PathLike[str], tag: Any, client_state: Any,
         save_latest: bool) -> Path:
    """Write ``<save_dir>/<tag>`` and (rank 0) ``<save_dir>/latest``. Collective."""
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    path = Path(save_dir) / tag
    extras = {"client_state": {} if client_state is None else client_state,
              "lr_scheduler": None if engine.lr_scheduler is None else engine.lr_scheduler.state_dict(),
              "micro_steps": engine.micro_steps}

    def files(tmp: Path) -> None:
        torch.save(extras, tmp / CLIENT)

    engine.save(path, files=files)
    if save_latest and engine.topo.rank == 0:
        atomic_write_text(Path(save_dir) / LATEST, tag)
    engine.topo.comm.barrier(engine.topo.world)
    return path


def _refuse_deepspeed(path: Path) -> None:
    if path.is_dir() and any(next(path.glob(p), None) is not None for p in DEEPSPEED_FILES):
        raise CheckpointError(f"load_checkpoint: {path} is a DeepSpeed checkpoint (mp_rank_00_model_states.pt / "
                              f"zero_pp_rank_* files), which hybridpar cannot read yet; {WAY_OUT}")


def resolve(load_dir: str | os.PathLike[str], tag: Any) -> Path:
    """The checkpoint directory ``load_checkpoint(load_dir, tag)`` names, or one CheckpointError."""
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointError(f"load_checkpoint: {root} is not a directory; give the save_dir of save_checkpoint")
    _refuse_deepspeed(root)
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            raise CheckpointError(f"load_checkpoint: {root} is not a checkpoint directory (no '{LATEST}' file and no "
                                  f"tag given); give the save_dir of save_checkpoint (a DeepSpeed checkpoint: {WAY_OUT})")
        tag = latest.read_text().strip()
    path = root / str(tag)
    _refuse_deepspeed(path)
    if not (path / CLIENT).is_file():
        raise CheckpointError(f"load_checkpoint: {path} is not a checkpoint written by save_checkpoint (no {CLIENT}); "
                              f"give the save_dir and tag of one (a DeepSpeed checkpoint: {WAY_OUT})")
    return path


def load(engine: DeepSpeedEngine, load_dir: str | os.PathLike[str], tag: Any) -> tuple[str, Any]:
    """Restore ``engine`` from ``<load_dir>/<tag>`` (``latest`` when ``tag`` is None): weights,
    optimizer state (resharded to this engine's dp size and ZeRO stage), step counts, the fp16
    loss scale, a client scheduler's state; returns ``(path, client_state)``. Collective."""
    path = resolve(load_dir, tag)
    engine.load(path)
    try:
        extras = torch.load(path / CLIENT, weights_only=True)
    except Exception as e:  # noqa: BLE001 - an unreadable file is the user's, said in one line
        raise CheckpointError(f"load_checkpoint: {path / CLIENT} could not be read ({e})") from None
    if engine.lr_scheduler is not None and extras.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(extras["lr_scheduler"])
    engine.micro_steps = int(extras.get("micro_steps", 0))
    engine._set_lr(engine.global_step + 1)
    return str(path), extras["client_state"]
