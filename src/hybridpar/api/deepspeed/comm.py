"""``deepspeed.comm`` for ``import hybridpar as deepspeed`` (``hybridpar.comm``): DeepSpeed's
wrapper over ``torch.distributed``, whose functions keep torch's signatures, so the names map onto
torch's own. ``init_distributed`` is :func:`hybridpar.init_distributed` (DeepSpeed's keywords);
``get_local_rank`` reads torchrun's ``LOCAL_RANK``. Calls made here are the user's own and are not
in hybridpar's traffic counts (those count the engine's collectives)."""

from __future__ import annotations

import os

from torch.distributed import (
    ReduceOp,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    get_rank,
    get_world_size,
    is_available,
    is_initialized,
    new_group,
    reduce,
    reduce_scatter,
)

from hybridpar.distributed.mesh import init_distributed

__all__ = ["ReduceOp", "all_gather", "all_reduce", "barrier", "broadcast", "get_local_rank", "get_rank",
           "get_world_size", "init_distributed", "is_available", "is_initialized", "new_group", "reduce",
           "reduce_scatter"]


def get_local_rank() -> int:
    """This process's rank on its node (torchrun's ``LOCAL_RANK``; 0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))
