"""The FLOPs of one optimizer step: the model's (PaLM accounting, what MFU divides by) and the
extra forward FLOPs recomputation adds (what the hardware FLOPs add), for :mod:`hybridpar.planner.price.cost`."""

from __future__ import annotations

import functools

from hybridpar.config import ModelConfig
from hybridpar.planner.model import sac
from hybridpar.planner.model.layout import (
    Layout,
    ModelKey,
    Workload,
    flops_per_token_of,
    model_key,
    model_of,
)


def model_flops(model: ModelConfig, work: Workload) -> float:
    """Model FLOPs of one step: ``flops_per_token(seq) * tokens`` (PaLM accounting)."""
    return flops_per_token_of(model, work.seq_len) * work.global_batch * work.seq_len


def recompute_flops(model: ModelConfig, layout: Layout, work: Workload) -> float:
    """Extra forward FLOPs recomputation adds per step (layers only, not the head); memoised
    per model shape, recompute level and workload (the search asks for each candidate)."""
    return _recompute_flops(model_key(model), layout.recompute, work)


@functools.lru_cache(maxsize=4096)
def _recompute_flops(key: ModelKey, recompute: str, work: Workload) -> float:
    model = model_of(key)
    tokens = work.global_batch * work.seq_len
    attn = 4.0 * model.n_layers * model.dim * work.seq_len * tokens
    if recompute == "full":
        layer_matmul = (model.num_params() - model.vocab_size * model.dim * (1 if model.tie_embeddings else 2)
                        - model.dim * (2 * model.n_layers + 1))
        return 2.0 * layer_matmul * tokens + attn
    if recompute == "selective" and work.selective_ac == "op":  # the rerun GEMMs, not attention
        q, kv = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
        return 2.0 * model.n_layers * sac.recomputed_gemm_params(model.dim, q, kv, model.ffn_hidden) * tokens
    return attn if recompute == "selective" else 0.0
