"""A thin module-level facade over :class:`~hybridpar.distributed.mesh.Topology`.

For users who like the Megatron style (``initialize_parallelism(...)`` once, then
``get_tensor_parallel_group()`` anywhere). It keeps exactly one :class:`Topology` in this
module and answers from it; nothing else in hybridpar reads it (library code takes the topology
explicitly), so mixing both styles is safe.

Groups: each accessor returns the ``torch.distributed`` process group of that mesh axis (a
size-1 group when the axis has size 1), or ``None`` in a single process started without a
launcher, where no process group exists and no collective is needed.
"""

from __future__ import annotations

import torch.distributed as dist

from hybridpar.distributed.mesh import Axis, ParallelDims, Topology, init_distributed

__all__ = [
    "destroy_parallelism",
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
    "initialize_parallelism",
    "is_parallelism_initialized",
]

_topology: Topology | None = None


def backend_device_type(backend: str | None) -> str:
    """``"cuda"`` under NCCL (the initialized group's backend, else ``backend``), else ``"cpu"``."""
    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
    return "cuda" if backend == "nccl" else "cpu"


def initialize_parallelism(data_parallel_size: int | None = None, tensor_parallel_size: int = 1,
                           pipeline_parallel_size: int = 1, context_parallel_size: int = 1, *,
                           backend: str | None = None, device_type: str | None = None,
                           timeout_s: float = 300.0) -> Topology:
    """Set up the parallel layout of this process and return its :class:`Topology`.

    Initializes ``torch.distributed`` from the ``torchrun`` environment if that has not been
    done (gloo on CPU machines, nccl with a GPU; ``backend`` overrides). ``data_parallel_size``
    defaults to whatever the world size leaves after tp * pp * cp (1 in a plain single process).
    Collective: every rank calls it with the same sizes. Calling it again replaces the previous
    layout (its process groups are destroyed first).

    Raises ``ValueError`` when the sizes do not multiply to the world size, naming the numbers.
    """
    global _topology
    _, world = init_distributed(backend, timeout_s)
    inner = tensor_parallel_size * pipeline_parallel_size * context_parallel_size
    if data_parallel_size is None:
        if inner < 1 or world % inner:
            raise ValueError(f"world size {world} is not divisible by tensor_parallel_size * "
                             f"pipeline_parallel_size * context_parallel_size = {inner}; launch a "
                             f"multiple of {inner} processes")
        data_parallel_size = world // inner
    dims = ParallelDims(dp=data_parallel_size, tp=tensor_parallel_size, pp=pipeline_parallel_size,
                        cp=context_parallel_size)
    if dims.world_size != world:
        raise ValueError(f"data_parallel_size * tensor_parallel_size * pipeline_parallel_size * "
                         f"context_parallel_size = {dims.dp} * {dims.tp} * {dims.pp} * {dims.cp} = "
                         f"{dims.world_size} but {world} processes are running; launch "
                         f"{dims.world_size} (torchrun --nproc-per-node {dims.world_size}) or change the sizes")
    destroy_parallelism()
    _topology = dims.build(device_type or backend_device_type(backend))
    return _topology


def destroy_parallelism() -> None:
    """Forget the facade's topology and destroy its process groups (not the default group)."""
    global _topology
    topo, _topology = _topology, None
    if topo is not None:
        topo.close()


def is_parallelism_initialized() -> bool:
    """Whether :func:`initialize_parallelism` has been called (and not destroyed)."""
    return _topology is not None


def get_topology() -> Topology:
    """The topology made by :func:`initialize_parallelism`; raises ``RuntimeError`` before it."""
    if _topology is None:
        raise RuntimeError("parallelism is not initialized: call hybridpar.initialize_parallelism(...) first")
    return _topology


def _axis(name: str) -> Axis:
    return get_topology().axis(name)


def _group(name: str) -> dist.ProcessGroup | None:
    topo = get_topology()
    if topo.mesh is None:  # single process: no process group at all
        return None
    return topo.axis(name).group or topo.mesh.get_group(name)


def get_data_parallel_group() -> dist.ProcessGroup | None:
    """Process group of the ranks holding the same model shard and different data."""
    return _group("dp")


def get_tensor_parallel_group() -> dist.ProcessGroup | None:
    """Process group of the ranks splitting each layer (consecutive global ranks)."""
    return _group("tp")


def get_pipeline_parallel_group() -> dist.ProcessGroup | None:
    """Process group of the ranks holding successive pipeline stages."""
    return _group("pp")


def get_context_parallel_group() -> dist.ProcessGroup | None:
    """Process group of the ranks splitting each sequence (ring attention)."""
    return _group("cp")


def get_data_parallel_rank() -> int:
    """This rank's index within its data-parallel group."""
    return _axis("dp").rank


def get_tensor_parallel_rank() -> int:
    """This rank's index within its tensor-parallel group."""
    return _axis("tp").rank


def get_pipeline_parallel_rank() -> int:
    """This rank's pipeline stage index (its index within its pipeline group)."""
    return _axis("pp").rank


def get_context_parallel_rank() -> int:
    """This rank's index within its context-parallel group."""
    return _axis("cp").rank


def get_data_parallel_world_size() -> int:
    """Size of the data-parallel axis."""
    return _axis("dp").size


def get_tensor_parallel_world_size() -> int:
    """Size of the tensor-parallel axis."""
    return _axis("tp").size


def get_pipeline_parallel_world_size() -> int:
    """Size of the pipeline-parallel axis (number of pipeline ranks)."""
    return _axis("pp").size


def get_context_parallel_world_size() -> int:
    """Size of the context-parallel axis."""
    return _axis("cp").size
