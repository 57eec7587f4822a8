"""``deepspeed.zero`` for ``import hybridpar as deepspeed`` (``hybridpar.zero``): ``Init`` and
``GatheredParameters``, as far as they map onto hybridpar, where :func:`hybridpar.initialize`
shards a model built whole. What does not map: docs/howto/deepspeed.md, "Not provided".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["GatheredParameters", "Init"]


class Init(contextlib.AbstractContextManager):
    """``deepspeed.zero.Init``: DeepSpeed shards each parameter as the model is built; here the
    model is built whole and :func:`hybridpar.initialize` shards it (ZeRO-3 by the ds_config).
    Every argument is accepted and the block runs unchanged: the same model, built whole, which
    needs one whole copy of the model in host memory per process while it is built."""

    def __init__(self, module: nn.Module | None = None, *args: Any, **kwargs: Any) -> None:
        self.module = module

    def __exit__(self, *exc: object) -> None:
        return None


@contextlib.contextmanager
def GatheredParameters(params: nn.Parameter | Iterable[nn.Parameter] | None,  # noqa: N802 (DeepSpeed's name)
                       modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                       enabled: bool = True) -> Iterator[None]:
    """``deepspeed.zero.GatheredParameters``: the block sees the parameters whole, and with
    ``modifier_rank`` every rank leaves it with that rank's values (a broadcast, as DeepSpeed).
    Here a model is whole until :func:`hybridpar.initialize` (``Init`` shards nothing), so before
    it the block runs on the real parameters: DeepSpeed's pattern of initializing or editing
    weights on one rank maps exactly. After ``initialize`` under ZeRO-3 a module's parameters
    are this rank's shards: read the whole weights with ``engine.full_state_dict()`` instead."""
    yield
    if not enabled or modifier_rank is None:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        tensors = [params] if isinstance(params, torch.Tensor) else list(params or [])
        with torch.no_grad():
            for p in tensors:
                dist.broadcast(p.data, src=modifier_rank)
