"""The rules of the model's shape and of the run's settings (sizes, the recipe, compilation)."""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

from hybridpar.rules.base import MODEL_CHECKS, first_message, model_rule, rule

if TYPE_CHECKING:
    from hybridpar.config import Config, ModelConfig

#: the model families whose layers may be mixtures of experts (their Hugging Face mapping knows experts)
MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
#: train.optimizer_impl: which torch kernel runs the update ("auto": fused where the device and dtype allow)
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "for-loop")

# ----------------------------------------------------------------------------- model shape


@model_rule("model-sizes-positive")
def _model_sizes(m: ModelConfig) -> str | None:
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "max_seq_len"):
        if getattr(m, key) < 1:
            return f"model.{key} = {getattr(m, key)} must be >= 1"
    if m.kv_channels < 0:
        return f"model.kv_channels = {m.kv_channels} must be >= 0 (0 = dim / n_heads)"
    return None


@model_rule("model-heads-divide-dim")
def _heads_divide_dim(m: ModelConfig) -> str | None:
    if m.kv_channels == 0 and m.dim % m.n_heads:
        return (f"model.dim = {m.dim} is not divisible by model.n_heads = {m.n_heads}; pick a dim that is a "
                "multiple of n_heads (or set model.kv_channels, the head size)")
    return None


@model_rule("model-rope-even-head")
def _rope_even(m: ModelConfig) -> str | None:
    if m.family != "gpt2" and m.head_dim % 2:
        return f"head dim = {m.head_dim} must be even for RoPE"
    return None


@model_rule("model-rope-type")
def _rope_type(m: ModelConfig) -> str | None:
    types = ("default", "linear", "dynamic", "yarn", "llama3")  # hybridpar.models.rope.ROPE_TYPES
    if m.rope_type not in types:
        return f"model.rope_type = {m.rope_type!r} is not supported; supported: {', '.join(types)}"
    if m.family == "gpt2" and m.rope_type != "default":
        return f"model.rope_type = {m.rope_type!r}: gpt2 has learned positions, no RoPE; set --model.rope_type default"
    return None


@model_rule("model-gqa-groups")
def _gqa(m: ModelConfig) -> str | None:
    if m.n_kv_heads > m.n_heads or m.n_heads % m.n_kv_heads:
        return (f"model.n_heads = {m.n_heads} must be a multiple of model.n_kv_heads = {m.n_kv_heads} "
                "(grouped-query attention)")
    return None


@model_rule("model-gpt2-shape")
def _gpt2_shape(m: ModelConfig) -> str | None:
    if m.family != "gpt2":
        return None
    if m.n_kv_heads != m.n_heads:
        return (f"model.n_kv_heads = {m.n_kv_heads} but model.n_heads = {m.n_heads}: gpt2 has one key/value "
                f"head per query head; set --model.n_kv_heads {m.n_heads}")
    if m.kv_channels and m.kv_channels * m.n_heads != m.dim:
        return (f"model.kv_channels = {m.kv_channels}: gpt2's head size is model.dim / model.n_heads = "
                f"{m.dim // m.n_heads}; set --model.kv_channels 0")
    if m.qk_norm:
        return "model.qk_norm = true: gpt2 has no q/k norms; set --model.qk_norm false"
    return None


@model_rule("model-positive-constants")
def _constants(m: ModelConfig) -> str | None:
    return None if m.rope_theta > 0 and m.norm_eps > 0 else "model.rope_theta and model.norm_eps must be > 0"


@model_rule("model-moe-shape")
def _moe_shape(m: ModelConfig) -> str | None:
    if m.n_experts < 0 or m.n_shared_experts < 0 or m.moe_ffn_hidden < 0:
        return "model.n_experts, model.n_shared_experts and model.moe_ffn_hidden must be >= 0"
    if m.n_experts == 0:
        return None
    if not 1 <= m.experts_per_token <= m.n_experts:
        return (f"model.experts_per_token = {m.experts_per_token} must be between 1 and model.n_experts = "
                f"{m.n_experts}")
    if m.family not in MOE_FAMILIES:
        return (f"model.n_experts = {m.n_experts} needs a mixture-of-experts family (model.family one of "
                f"{', '.join(MOE_FAMILIES)}), not {m.family!r}: e.g. --model.family mixtral")
    try:
        layers = m.moe_layer_ids()
    except ValueError:
        return f"model.moe_layers = {m.moe_layers!r} must be comma-separated layer indices, e.g. \"1,3,5\" (\"\" = all)"
    bad = [i for i in layers if not 0 <= i < m.n_layers]
    if bad:
        return f"model.moe_layers = {m.moe_layers!r} names layer {bad[0]}, outside 0..{m.n_layers - 1}"
    if m.aux_loss_coef < 0 or m.z_loss_coef < 0 or m.bias_update_rate < 0:
        return "model.aux_loss_coef, model.z_loss_coef and model.bias_update_rate must be >= 0"
    return None


# ----------------------------------------------------------------------------- settings


@rule("parallel-sizes-positive")
def _parallel_sizes(cfg: Config, world: int | None) -> str | None:
    p = cfg.parallel
    for key in ("dp", "tp", "pp", "cp", "ep", "virtual_stages"):
        if getattr(p, key) < 1:
            return f"parallel.{key} = {getattr(p, key)} must be >= 1"
    if p.zero_stage not in (0, 1, 2, 3):
        return f"parallel.zero_stage = {p.zero_stage} must be 0, 1, 2 or 3"
    if p.bucket_mb <= 0:
        return f"parallel.bucket_mb = {p.bucket_mb} must be > 0"
    if p.node_size < 0:
        return f"parallel.node_size = {p.node_size} must be >= 0 (0 = LOCAL_WORLD_SIZE)"
    if p.microbatches < 0:
        return f"parallel.microbatches = {p.microbatches} must be >= 0 (0 = automatic)"
    return None


@rule("hierarchical-dp-without-zero")
def _hierarchical(cfg: Config, world: int | None) -> str | None:
    p = cfg.parallel
    if p.hierarchical_dp and p.zero_stage > 0 and p.dp_shard in (0, p.dp * p.cp):
        return (f"parallel.hierarchical_dp = true with parallel.zero_stage = {p.zero_stage} and one ZeRO group of all "
                f"{p.dp * p.cp} dp x cp ranks leaves no all-reduce to split (ZeRO reduce-scatters over the group "
                "itself); set parallel.dp_shard to the ranks of a node or fewer (hybrid sharding: the replicas' "
                "all-reduce is then hierarchical), or zero_stage = 0, or hierarchical_dp = false")
    return None


@rule("train-settings")
def _train_settings(cfg: Config, world: int | None) -> str | None:
    t = cfg.train
    for key in ("steps", "global_batch", "micro_batch", "seq_len", "log_every", "eval_batches"):
        if getattr(t, key) < 1:
            return f"train.{key} = {getattr(t, key)} must be >= 1"
    for key in ("eval_every", "checkpoint_every", "keep_checkpoints", "warmup_steps", "sample_tokens",
                "loss_chunk_tokens"):
        if getattr(t, key) < 0:
            return f"train.{key} = {getattr(t, key)} must be >= 0"
    if not (t.lr > 0 and 0 <= t.min_lr <= t.lr):
        return f"need 0 <= train.min_lr ({t.min_lr}) <= train.lr ({t.lr}) and lr > 0"
    if not (0 <= t.beta1 < 1 and 0 <= t.beta2 < 1):
        return f"train.beta1 = {t.beta1}, beta2 = {t.beta2} must be in [0, 1)"
    if t.loss_scale_init < 1 or t.loss_scale_window < 1:
        return (f"train.loss_scale_init = {t.loss_scale_init} must be >= 1 and train.loss_scale_window = "
                f"{t.loss_scale_window} >= 1")
    if t.max_skipped_steps < 0:
        return f"train.max_skipped_steps = {t.max_skipped_steps} must be >= 0"
    if t.timeout_s <= 0:
        return f"train.timeout_s = {t.timeout_s} must be > 0 seconds"
    if t.snapshot_every < -1:
        return f"train.snapshot_every = {t.snapshot_every} must be >= 0 (or -1: every step under a launcher's store)"
    if not 0 < t.snapshot_memory_fraction <= 1:
        return f"train.snapshot_memory_fraction = {t.snapshot_memory_fraction} must be in (0, 1]"
    if t.grad_clip < 0:
        return f"train.grad_clip = {t.grad_clip} must be >= 0 (0 disables clipping)"
    return None


def optimizer_impl_error(impl: str, key: str = "train.optimizer_impl") -> str | None:
    """The message for an optimizer implementation name that is not one of
    :data:`OPTIMIZER_IMPLS` (``key``: how the caller spells the setting), or None."""
    if impl in OPTIMIZER_IMPLS:
        return None
    return (f"{key} = {impl!r} is not an optimizer implementation; use 'auto' (fused where the device and dtype "
            "support it), 'fused', 'foreach' or 'for-loop'")


@rule("train-optimizer-impl")
def _optimizer_impl(cfg: Config, world: int | None) -> str | None:
    return optimizer_impl_error(cfg.train.optimizer_impl)


@rule("train-compile-inductor")
def _compile_inductor(cfg: Config, world: int | None) -> str | None:
    # inductor writes C++ (CPU kernels, and the host code of GPU ones) and builds it with the
    # compiler in $CXX or g++; and torch 2.13's inductor emits at::vec code without its header
    # when ATEN_CPU_CAPABILITY is "default" (no vector ISA). Either way the first step would fail
    # deep inside torch.
    t = cfg.train
    if not (t.compile and t.compile_backend == "inductor"):
        return None
    prefix = "train.compile = true with train.compile_backend = 'inductor'"
    if not any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "clang++", "c++") if c):
        return (f"{prefix} needs a C++ compiler (set $CXX, or install g++), and none was found on PATH; install "
                "one, or set train.compile_backend = 'aot_eager' (traced graphs, eager kernels) or train.compile = false")
    if t.device != "cuda" and os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        return (f"{prefix} cannot build CPU kernels while ATEN_CPU_CAPABILITY=default (torch's inductor emits vector "
                "code for it anyway); unset ATEN_CPU_CAPABILITY or set it to avx2/avx512, or use "
                "train.compile_backend = 'aot_eager'")
    return None


@rule("seq-len-fits-model")
def _seq_len_fits(cfg: Config, world: int | None) -> str | None:
    t, m = cfg.train, cfg.model
    if t.seq_len > m.max_seq_len:
        return (f"train.seq_len = {t.seq_len} exceeds model.max_seq_len = {m.max_seq_len}; lower seq_len or "
                "raise max_seq_len")
    return None



def model_error(model: ModelConfig) -> str | None:
    """The message of the first ``model-*`` rule ``model`` breaks, or None: what a family's
    model checks when it is built outside a validated run."""
    return first_message(MODEL_CHECKS, model)
