"""The ``[parallel]`` section: the mesh axes, how each is used (the layout), and how its traffic
is carried."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["CpMode", "GradCompression", "LayoutChoice", "MeshAxes", "OffloadTarget", "ParallelConfig", "Recompute",
           "Schedule"]

Schedule = Literal["gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "2bw"]
Recompute = Literal["none", "selective", "full"]
GradCompression = Literal["none", "bf16", "fp16", "int8"]
OffloadTarget = Literal["cpu", "disk"]
CpMode = Literal["ring", "ulysses", "hybrid"]


@dataclass
class MeshAxes:
    """The sizes of the four mesh axes, stated once (world size = dp * tp * pp * cp; the mesh
    orders them (pp, dp, cp, tp)). The runtime's :class:`hybridpar.distributed.mesh.ParallelDims`
    is these plus the topology it builds; :class:`LayoutChoice` adds how each axis is used."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


@dataclass
class LayoutChoice(MeshAxes):
    """What a layout chooses, stated once: the mesh axes and how each is used.
    :class:`ParallelConfig` adds a run's communication settings, the planner's candidates
    (:class:`hybridpar.planner.model.layout.Layout`) the micro-batch size."""

    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_to: OffloadTarget = "cpu"  # where offloaded state lives: host memory, or files (ZeRO-Infinity)
    offload_params: bool = False  # ZeRO-3: parameter shards offloaded too (to offload_to)
    ep: int = 1  # expert parallelism: experts sharded over ep ranks carved out of dp x cp
    # hybrid sharding (HSDP): ZeRO-1/2/3 shard inside groups of dp_shard consecutive dp x cp ranks and
    # all-reduce across the dp x cp / dp_shard groups (replicas); 0 = one group of all dp x cp ranks
    dp_shard: int = 0
    pipeline_schedule: Schedule = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    recompute: Recompute = "none"
    # activation offload: what the first offload_activations_fraction of each pipeline chunk's blocks save
    # for backward goes to host memory in forward and comes back ahead of their backward
    # (hybridpar.parallel.offload_activations; rule offload-activations-fraction)
    offload_activations: bool = False
    offload_activations_fraction: float = 1.0
    # data-parallel gradient payload: int8 (block-wise, error feedback; any ZeRO stage) or
    # bf16/fp16 (ZeRO stages 1-3); see hybridpar.distributed.compression
    grad_compression: GradCompression = "none"
    # context parallelism over cp: ring attention, Ulysses all-to-all (heads), or hybrid (USP:
    # cp_ulysses ranks of Ulysses inside cp, ring across cp / cp_ulysses); hybridpar.parallel.ulysses
    cp_mode: CpMode = "ring"
    cp_ulysses: int = 0  # hybrid: the Ulysses degree (read only with cp_mode = "hybrid")

    def cp_split(self) -> tuple[int, int]:
        """``(ulysses, ring)`` degrees of the cp axis (their product is cp): ring (1, cp),
        ulysses (cp, 1), hybrid (cp_ulysses, cp / cp_ulysses)."""
        u = {"ring": 1, "ulysses": self.cp}.get(self.cp_mode, self.cp_ulysses)
        return u, self.cp // max(1, u)


@dataclass
class ParallelConfig(LayoutChoice):
    """The ``[parallel]`` section: the layout plus how its traffic is carried."""

    microbatches: int = 0  # 0: global batch / (dp * micro batch)
    bucket_mb: float = 25.0  # gradient all-reduce bucket size for data parallelism
    hierarchical_dp: bool = False  # dp gradients: reduce-scatter in node, all-reduce across, all-gather
    node_size: int = 0  # ranks per node for hierarchical_dp; 0 = the launcher's LOCAL_WORLD_SIZE
    offload_dir: str = ""  # offload_to = "disk": where the files go; "" = the system temporary directory
    auto: bool = False  # train: the planner picks dp/tp/pp/cp, ZeRO stage, schedule, micro-batch for the world size
    stage_layers: str = ""  # pipeline: layers per stage in model order by hand, e.g. "4,8,8,6"; "" = balanced by FLOPs

    def layer_counts(self) -> list[int] | None:
        """``stage_layers`` as integers (None when unset); ValueError when it is not a list of ints."""
        if not self.stage_layers.strip():
            return None
        return [int(x) for x in self.stage_layers.split(",")]
