"""Rates the step-time model (:mod:`hybridpar.planner.price.cost`) and the cp pricing
(:mod:`hybridpar.planner.price.cp`) share: one all-to-all's seconds on the cluster, and the
per-layer memory traffic of this runtime's weight casts and gradient clipping, priced by the
device's memory-bound efficiency (:func:`hybridpar.planner.machine.efficiency.memory_time`)."""

from __future__ import annotations

from hybridpar.config import ModelConfig
from hybridpar.planner.machine.efficiency import memory_time
from hybridpar.planner.machine.hardware import Cluster, GPUSpec
from hybridpar.planner.model.layout import BlockStyle, Layout, Workload, num_params_of


def all_to_all_time(cluster: Cluster, nbytes: float, size: int, stride: int) -> float:
    """Seconds of one all-to-all over ``size`` ranks spaced ``stride`` apart in which the rank
    moves at most ``nbytes`` each way to and from the others (spread evenly over them, sends and
    receives concurrent): the peers in its node over NVLink, the others over its own NIC, both
    at once, plus one latency (the exchanges to all peers run concurrently)."""
    if size <= 1:
        return 0.0
    g = cluster.gpu
    local = max(1, min(size, cluster.gpus_per_node // max(1, stride)))  # group members per node
    remote = (size - local) / (size - 1)
    intra = (1 - remote) * nbytes / (g.intra_bw * g.comm_efficiency)
    if remote == 0:
        return intra + g.intra_latency
    return max(intra, remote * nbytes / (g.inter_bw * g.comm_efficiency)) + g.inter_latency


def layer_param_numel(model: ModelConfig) -> float:
    """Matmul parameters of the mean decoder layer (all but the embedding, head and norms)."""
    return (model.num_params() - model.vocab_size * model.dim * (1 if model.tie_embeddings else 2)
            - model.dim * (2 * model.n_layers + 1)) / model.n_layers


def weight_traffic(model: ModelConfig, L: Layout, work: Workload, g: GPUSpec) -> tuple[float, float]:
    """(forward, backward) seconds per layer and micro-batch of this runtime's per-parameter
    memory traffic under autocast (fp32 parameters, half-precision matmuls): forward, each
    weight's half-precision copy (read 4, write 2 bytes per parameter); backward, the weight
    gradient's cast back to fp32 (read 2, write 4) and, after the step's first micro-batch, its
    accumulation into ``.grad`` (read 4 + 4, write 4), averaged over the step's micro-batches.
    Megatron-LM keeps half-precision weights (no casts): none; fp32: none."""
    if work.style is BlockStyle.MEGATRON or work.act_bytes == 4 or work.half_params:
        return 0.0, 0.0
    p = layer_param_numel(model) / L.tp
    m = L.microbatches(work.global_batch)
    return memory_time(6 * p, g), memory_time(6 * p + 12 * p * (m - 1) / m, g)


def clip_time(model: ModelConfig, L: Layout, g: GPUSpec) -> float:
    """Seconds of gradient clipping on a rank's fp32 gradients (``train.grad_clip``): the norm
    reads them (4 bytes per parameter), the scale reads and writes them (8); ZeRO-2 and 3 clip
    the rank's shard."""
    shards = L.tp * L.pp * (L.dp * L.cp if L.zero_stage >= 2 else 1)
    return memory_time(12 * num_params_of(model) / shards, g)
