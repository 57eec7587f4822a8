"""The public library API: the facade, the engine, the tensor-parallel plan and PipelineModule.

Everything here is re-exported (lazily) from the ``hybridpar`` package itself.
"""

from hybridpar.api.engine import EngineConfig, ModelEngine
from hybridpar.api.facade import (
    destroy_parallelism,
    get_context_parallel_group,
    get_context_parallel_rank,
    get_context_parallel_world_size,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_pipeline_parallel_group,
    get_pipeline_parallel_rank,
    get_pipeline_parallel_world_size,
    get_tensor_parallel_group,
    get_tensor_parallel_rank,
    get_tensor_parallel_world_size,
    get_topology,
    initialize_parallelism,
    is_parallelism_initialized,
)
from hybridpar.api.front import initialize
from hybridpar.api.pipeline import PipelineModule
from hybridpar.api.tp import (
    full_tensor_parallel_state_dict,
    global_grad_norm,
    parallelize_module,
    tp_sharded_params,
)

__all__ = [
    "EngineConfig",
    "ModelEngine",
    "PipelineModule",
    "destroy_parallelism",
    "full_tensor_parallel_state_dict",
    "get_context_parallel_group",
    "get_context_parallel_rank",
    "get_context_parallel_world_size",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_pipeline_parallel_group",
    "get_pipeline_parallel_rank",
    "get_pipeline_parallel_world_size",
    "get_tensor_parallel_group",
    "get_tensor_parallel_rank",
    "get_tensor_parallel_world_size",
    "get_topology",
    "global_grad_norm",
    "initialize",
    "initialize_parallelism",
    "is_parallelism_initialized",
    "parallelize_module",
    "tp_sharded_params",
]
