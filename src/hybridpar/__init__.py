"""hybridpar: composable hybrid parallelism (DP/ZeRO, TP+SP, PP, CP) on torch.distributed.

The public names below are imported lazily (PEP 562 ``__getattr__``): ``import hybridpar`` is
cheap and does not import torch; the first use of a name imports its module. Reference:
``docs/reference/api.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # layout and the module-level facade
    "ParallelDims": "hybridpar.distributed.mesh",
    "Topology": "hybridpar.distributed.mesh",
    "init_distributed": "hybridpar.distributed.mesh",
    **dict.fromkeys([
        "initialize_parallelism", "destroy_parallelism", "is_parallelism_initialized", "get_topology",
        "get_data_parallel_group", "get_tensor_parallel_group", "get_pipeline_parallel_group",
        "get_context_parallel_group", "get_data_parallel_rank", "get_tensor_parallel_rank",
        "get_pipeline_parallel_rank", "get_context_parallel_rank", "get_data_parallel_world_size",
        "get_tensor_parallel_world_size", "get_pipeline_parallel_world_size",
        "get_context_parallel_world_size"], "hybridpar.api.facade"),
    # engine for any nn.Module
    "initialize": "hybridpar.api.front",
    "EngineConfig": "hybridpar.api.engine",
    "ModelEngine": "hybridpar.api.engine",
    "keep_host_heap": "hybridpar.distributed.device",  # opt-in process-wide malloc tuning (CPU)
    # tensor parallelism
    "ColumnParallelLinear": "hybridpar.parallel.tensor",
    "RowParallelLinear": "hybridpar.parallel.tensor",
    "VocabParallelEmbedding": "hybridpar.parallel.tensor",
    "vocab_parallel_cross_entropy": "hybridpar.parallel.tensor",
    "gather_logits": "hybridpar.parallel.tensor",
    "parallelize_module": "hybridpar.api.tp",
    "tp_sharded_params": "hybridpar.api.tp",
    "full_tensor_parallel_state_dict": "hybridpar.api.tp",
    "global_grad_norm": "hybridpar.api.tp",
    # pipeline parallelism
    "PipelineModule": "hybridpar.api.pipeline",
    "build_schedule": "hybridpar.parallel.pipeline",
    # data parallelism / ZeRO
    "ZeroOptimizer": "hybridpar.parallel.zero",
    "shard_model": "hybridpar.parallel.zero",
    "GradientReducer": "hybridpar.parallel.zero",
    # configuration of the built-in trainer
    "Config": "hybridpar.config",
    "ModelConfig": "hybridpar.config",
    "ParallelConfig": "hybridpar.config",
    "TrainConfig": "hybridpar.config",
    "load_config": "hybridpar.config",
    # DeepSpeed's module-level names, for `import hybridpar as deepspeed` (docs/howto/deepspeed.md)
    "add_config_arguments": "hybridpar.api.deepspeed.front",
}
# DeepSpeed's submodules under the same names: deepspeed.comm, deepspeed.zero, deepspeed.pipe
_MODULES: dict[str, str] = {"comm": "hybridpar.api.deepspeed.comm", "zero": "hybridpar.api.deepspeed.zero",
                            "pipe": "hybridpar.api.deepspeed.pipe"}

__all__ = sorted([*_EXPORTS, *_MODULES])


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
        globals()[name] = value
        return value
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridpar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
