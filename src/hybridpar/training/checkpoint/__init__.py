"""Checkpoints: model + optimizer through ``torch.distributed.checkpoint`` (so a later layout can
reshard them), plus the run's config and position as plain JSON.

Layout of ``<run_dir>/checkpoints/step-000010/``: DCP's ``.distcp`` shards and ``.metadata``,
``config.json``, the tokenizer files, and ``complete.json`` written last with the size and
sha256 of every other file. Everything is written into ``.tmp-step-000010`` first, fsynced, and
renamed once every rank has finished, so a directory named ``step-*`` with a ``complete.json``
is always whole; anything else is ignored by ``--resume``. Re-saving an existing step moves the
old directory aside (``.old-step-N``) before the new one is renamed in; a crash in between
leaves the old one to be restored (:func:`recover`). Deleted checkpoints are first renamed to
``.del-step-N``, so a half-deleted one is never mistaken for a checkpoint.

The package, one seam per file (each imports only the public names of those before it):

- ``safe_metadata``: :class:`CheckpointError` and :class:`SafeReader`, DCP's metadata through an
  allow-list unpickler (nothing here unpickles untrusted data; tensors load ``weights_only``);
- ``durable``: fsync of files and directories, free space, full-disk detection, file hashes;
- ``manifest``: ``complete.json`` (written last, checked before anything loads) and ``config.json``;
- ``paths``: step directories, the latest whole checkpoint, ``--resume``, recovery after a crash;
- ``writer``: the one atomic sharded writer (:func:`write_checkpoint`), collective;
- ``background``: :class:`BackgroundWriter` (``async_checkpoint.enabled``) stages the state in host
  memory and runs the writer on a thread;
- ``state``: what a checkpoint holds, :func:`save` and :func:`load` (any layout), and the
  one-process readers (:func:`load_model_state`, :func:`load_tokenizer_of`).
"""

from hybridpar.training.checkpoint.background import BackgroundWriter, HostStager
from hybridpar.training.checkpoint.manifest import COMPLETE, is_complete, read_config, read_info
from hybridpar.training.checkpoint.paths import (
    latest_checkpoint,
    latest_verified_checkpoint,
    recover,
    require_complete,
    resolve_resume,
    step_dir,
)
from hybridpar.training.checkpoint.safe_metadata import CheckpointError, SafeReader
from hybridpar.training.checkpoint.state import load, load_model_state, load_tokenizer_of, save
from hybridpar.training.checkpoint.writer import single_process_quiet, write_checkpoint

__all__ = [
    "COMPLETE",
    "BackgroundWriter",
    "CheckpointError",
    "HostStager",
    "SafeReader",
    "is_complete",
    "latest_checkpoint",
    "latest_verified_checkpoint",
    "load",
    "load_model_state",
    "load_tokenizer_of",
    "read_config",
    "read_info",
    "recover",
    "require_complete",
    "resolve_resume",
    "save",
    "single_process_quiet",
    "step_dir",
    "write_checkpoint",
]
