"""Every shape and layout rule of a run, stated once, as values.

A :class:`Rule` has a ``name`` (what the planner reports when it rejects a layout) and a check
that returns ``None`` when the config keeps the rule, or the one-line message (numbers and fix)
when it breaks it. :func:`hybridpar.config.validate` raises the first broken rule's message;
the planner (:mod:`hybridpar.planner.layout`) asks :func:`first_broken` for the rule itself
instead of reading messages; model families check their tensor-parallel split with
:func:`tp_split_error` (the ``tp-*`` rules), so nothing restates a rule elsewhere.

Rules run in order: a rule may assume the ones before it hold (positive sizes first).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridpar.config import Config, ModelConfig

__all__ = ["RULES", "Rule", "first_broken", "model_error", "partition_error", "schedule_error", "tp_split_error"]

Check = Callable[["Config", "int | None"], "str | None"]


@dataclass(frozen=True)
class Rule:
    """One rule: its name and its check (``None`` = kept, else the message)."""

    name: str
    check: Check


RULES: list[Rule] = []

#: the model families whose layers may be mixtures of experts (their Hugging Face mapping knows experts)
MOE_FAMILIES = ("mixtral", "qwen3_moe")


def rule(name: str) -> Callable[[Check], Check]:
    """Register the decorated check as rule ``name`` (in definition order)."""
    def register(fn: Check) -> Check:
        RULES.append(Rule(name, fn))
        return fn
    return register


def first_broken(cfg: Config, world_size: int | None = None) -> tuple[Rule, str] | None:
    """The first rule ``cfg`` breaks and its message, or None."""
    for r in RULES:
        message = r.check(cfg, world_size)
        if message is not None:
            return r, message
    return None


# ----------------------------------------------------------------------------- model shape


@rule("model-sizes-positive")
def _model_sizes(cfg: Config, world: int | None) -> str | None:
    m = cfg.model
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "max_seq_len"):
        if getattr(m, key) < 1:
            return f"model.{key} = {getattr(m, key)} must be >= 1"
    if m.kv_channels < 0:
        return f"model.kv_channels = {m.kv_channels} must be >= 0 (0 = dim / n_heads)"
    return None


@rule("model-heads-divide-dim")
def _heads_divide_dim(cfg: Config, world: int | None) -> str | None:
    m = cfg.model
    if m.kv_channels == 0 and m.dim % m.n_heads:
        return (f"model.dim = {m.dim} is not divisible by model.n_heads = {m.n_heads}; pick a dim that is a "
                "multiple of n_heads (or set model.kv_channels, the head size)")
    return None


@rule("model-rope-even-head")
def _rope_even(cfg: Config, world: int | None) -> str | None:
    m = cfg.model
    if m.family != "gpt2" and m.head_dim % 2:
        return f"head dim = {m.head_dim} must be even for RoPE"
    return None


@rule("model-rope-type")
def _rope_type(cfg: Config, world: int | None) -> str | None:
    m = cfg.model
    types = ("default", "linear", "dynamic", "yarn", "llama3")  # hybridpar.models.rope.ROPE_TYPES
    if m.rope_type not in types:
        return f"model.rope_type = {m.rope_type!r} is not supported; supported: {', '.join(types)}"
    if m.family == "gpt2" and m.rope_type != "default":
        return f"model.rope_type = {m.rope_type!r}: gpt2 has learned positions, no RoPE; set --model.rope_type default"
    return None


@rule("model-gqa-groups")
def _gqa(cfg: Config, world: int | None) -> str | None:
    m = cfg.model
    if m.n_kv_heads > m.n_heads or m.n_heads % m.n_kv_heads:
        return (f"model.n_heads = {m.n_heads} must be a multiple of model.n_kv_heads = {m.n_kv_heads} "
                "(grouped-query attention)")
    return None


@rule("model-gpt2-shape")
def _gpt2_shape(cfg: Config, world: int | None) -> str | None:
    m = cfg.model
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


@rule("model-positive-constants")
def _constants(cfg: Config, world: int | None) -> str | None:
    m = cfg.model
    return None if m.rope_theta > 0 and m.norm_eps > 0 else "model.rope_theta and model.norm_eps must be > 0"


@rule("model-moe-shape")
def _moe_shape(cfg: Config, world: int | None) -> str | None:
    m = cfg.model
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
    if p.hierarchical_dp and p.zero_stage > 0:
        return (f"parallel.hierarchical_dp = true with parallel.zero_stage = {p.zero_stage} is not supported yet; "
                "ZeRO reduce-scatters over dp itself: use zero_stage = 0 or hierarchical_dp = false")
    return None


@rule("train-settings")
def _train_settings(cfg: Config, world: int | None) -> str | None:
    t = cfg.train
    for key in ("steps", "global_batch", "micro_batch", "seq_len", "log_every", "eval_batches"):
        if getattr(t, key) < 1:
            return f"train.{key} = {getattr(t, key)} must be >= 1"
    for key in ("eval_every", "checkpoint_every", "keep_checkpoints", "warmup_steps", "sample_tokens"):
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
    if t.grad_clip < 0:
        return f"train.grad_clip = {t.grad_clip} must be >= 0 (0 disables clipping)"
    return None


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


# ----------------------------------------------------------------------------- layout


@rule("dp-divides-batch")
def _dp_batch(cfg: Config, world: int | None) -> str | None:
    p, t = cfg.parallel, cfg.train
    if t.global_batch % (p.dp * t.micro_batch):
        return (f"train.global_batch = {t.global_batch} is not divisible by parallel.dp * train.micro_batch = "
                f"{p.dp} * {t.micro_batch} = {p.dp * t.micro_batch}; make global_batch a multiple of "
                f"{p.dp * t.micro_batch}")
    return None


@rule("tp-whole-kv-heads")
def _tp_kv_whole(cfg: Config, world: int | None) -> str | None:
    m, tp = cfg.model, cfg.parallel.tp
    if m.n_kv_heads < tp:
        return (f"model.n_kv_heads = {m.n_kv_heads} < parallel.tp = {tp}: every tp rank needs a whole KV head "
                f"(KV-head replication is not supported); use tp <= {m.n_kv_heads}")
    return None


@rule("tp-divides-heads")
def _tp_heads(cfg: Config, world: int | None) -> str | None:
    m, tp = cfg.model, cfg.parallel.tp
    if m.n_heads % tp:
        return f"model.n_heads = {m.n_heads} is not divisible by parallel.tp = {tp}; use a tp that divides {m.n_heads}"
    return None


@rule("tp-divides-kv-heads")
def _tp_kv(cfg: Config, world: int | None) -> str | None:
    m, tp = cfg.model, cfg.parallel.tp
    if m.n_kv_heads % tp:
        return (f"model.n_kv_heads = {m.n_kv_heads} is not divisible by parallel.tp = {tp}; use tp <= "
                f"{m.n_kv_heads} that divides it")
    return None


@rule("tp-divides-ffn")
def _tp_ffn(cfg: Config, world: int | None) -> str | None:
    m, tp = cfg.model, cfg.parallel.tp
    if m.ffn_hidden % tp:
        return f"model.ffn_hidden = {m.ffn_hidden} is not divisible by parallel.tp = {tp}; use a tp that divides it"
    return None


@rule("tp-divides-expert-ffn")
def _tp_expert_ffn(cfg: Config, world: int | None) -> str | None:
    m, tp = cfg.model, cfg.parallel.tp
    if m.n_experts and m.expert_hidden % tp:
        return (f"model.moe_ffn_hidden = {m.expert_hidden} is not divisible by parallel.tp = {tp} (experts are "
                "tensor-parallel like the dense MLP); use a tp that divides it")
    return None


@rule("ep-carved-from-dp-cp")
def _ep(cfg: Config, world: int | None) -> str | None:
    m, p = cfg.model, cfg.parallel
    if p.ep == 1:
        return None
    if m.n_experts == 0:
        return f"parallel.ep = {p.ep} needs a mixture-of-experts model (model.n_experts > 0); use ep = 1"
    if (p.dp * p.cp) % p.ep:
        return (f"parallel.ep = {p.ep} must divide parallel.dp * parallel.cp = {p.dp} * {p.cp} = {p.dp * p.cp} "
                "(expert-parallel ranks are carved out of the data- and context-parallel ones); raise dp or "
                "lower ep")
    if m.n_experts % p.ep:
        return f"model.n_experts = {m.n_experts} is not divisible by parallel.ep = {p.ep}; use an ep that divides it"
    if p.hierarchical_dp:
        return f"parallel.ep = {p.ep} with parallel.hierarchical_dp is not supported yet; turn one off"
    return None


@rule("pp-layer-per-chunk")
def _pp_layers(cfg: Config, world: int | None) -> str | None:
    m, p = cfg.model, cfg.parallel
    stages = p.pp * p.virtual_stages
    if m.n_layers < stages:
        return (f"model.n_layers = {m.n_layers} < parallel.pp * virtual_stages = {p.pp} * {p.virtual_stages} = "
                f"{stages} pipeline chunks; every chunk needs a layer: lower pp or virtual_stages, or add layers")
    return None


@rule("pp-stage-layers")
def _stage_layers(cfg: Config, world: int | None) -> str | None:
    m, p = cfg.model, cfg.parallel
    try:
        counts = p.layer_counts()
    except ValueError:
        return (f"parallel.stage_layers = {p.stage_layers!r} is not a comma-separated list of layer counts; "
                f"write one integer per pipeline stage in model order, e.g. '4,8,8,6'")
    stages = p.pp * p.virtual_stages
    if counts is None:
        return None
    if len(counts) != stages or min(counts) < 1 or sum(counts) != m.n_layers:
        return (f"parallel.stage_layers = {p.stage_layers!r} gives {len(counts)} stages summing to {sum(counts)} "
                f"layers; it needs pp * virtual_stages = {stages} counts, each >= 1, summing to "
                f"model.n_layers = {m.n_layers}")
    return None


@rule("virtual-stages-need-interleaved")
def _virtual(cfg: Config, world: int | None) -> str | None:
    p = cfg.parallel
    if p.virtual_stages != 1 and p.pipeline_schedule not in ("interleaved", "zbv"):
        return (f"parallel.virtual_stages = {p.virtual_stages} needs parallel.pipeline_schedule = 'interleaved' "
                f"(or 'zbv' with 2), not {p.pipeline_schedule!r}; or set virtual_stages = 1")
    return None


@rule("virtual-stages-zbv")
def _zbv(cfg: Config, world: int | None) -> str | None:
    p = cfg.parallel
    if p.pipeline_schedule == "zbv" and p.virtual_stages != 2:
        return (f"parallel.pipeline_schedule = 'zbv' needs parallel.virtual_stages = 2 (two chunks per rank "
                f"placed as a V), got {p.virtual_stages}; set virtual_stages = 2")
    return None


@rule("interleaved-needs-pp")
def _interleaved_pp(cfg: Config, world: int | None) -> str | None:
    p = cfg.parallel
    if p.pipeline_schedule == "interleaved" and p.virtual_stages > 1 and p.pp < 2:
        return (f"parallel.pipeline_schedule = 'interleaved' with parallel.virtual_stages = {p.virtual_stages} "
                f"needs parallel.pp >= 2 (got {p.pp}); set virtual_stages = 1 without pipelining")
    return None


@rule("microbatches-match-batch")
def _microbatches(cfg: Config, world: int | None) -> str | None:
    p, t = cfg.parallel, cfg.train
    micro = cfg.microbatches
    if p.microbatches not in (0, micro):
        return (f"parallel.microbatches = {p.microbatches} but global_batch / (dp * micro_batch) = "
                f"{t.global_batch} / ({p.dp} * {t.micro_batch}) = {micro}; set train.micro_batch = "
                f"{t.global_batch // max(1, p.dp * p.microbatches)} or leave parallel.microbatches = 0")
    return None


@rule("interleaved-microbatches-divisible")
def _interleaved(cfg: Config, world: int | None) -> str | None:
    p = cfg.parallel
    micro = cfg.microbatches
    rem = micro % p.pp
    if p.pipeline_schedule == "interleaved" and rem:
        down, up = micro - rem, micro - rem + p.pp
        fix = f"{down} or {up}" if down >= p.pp else f"{up}"
        return (f"interleaved 1F1B needs micro-batches per step divisible by parallel.pp: {micro} % {p.pp} = "
                f"{rem}; use {fix} micro-batches (train.global_batch / (dp * train.micro_batch))")
    return None


@rule("pp-2bw-microbatches")
def _two_bw_microbatches(cfg: Config, world: int | None) -> str | None:
    p, t = cfg.parallel, cfg.train
    if p.pipeline_schedule != "2bw":
        return None
    if p.pp < 2:
        return (f"parallel.pipeline_schedule = '2bw' needs parallel.pp >= 2 (got {p.pp}): PipeDream-2BW overlaps "
                "consecutive steps across pipeline stages; raise pp or use pipeline_schedule = '1f1b'")
    micro = cfg.microbatches
    if micro < p.pp:
        return (f"PipeDream-2BW needs at least parallel.pp = {p.pp} micro-batches per step, got train.global_batch / "
                f"(dp * train.micro_batch) = {t.global_batch} / ({p.dp} * {t.micro_batch}) = {micro}; raise "
                f"global_batch to {p.pp * p.dp * t.micro_batch} or lower micro_batch")
    return None


def _two_bw_conflict(cfg: Config) -> tuple[str, str, str] | None:
    """What 2BW does not compose with in ``cfg``, as (the values, why, the fix); None if nothing."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    if p.zero_stage > 0:
        return (f"parallel.zero_stage = {p.zero_stage}", "ZeRO-1/2 step views into each parameter's storage and "
                "ZeRO-3 re-gathers parameters for every forward, while 2BW keeps two weight versions and moves the "
                "optimizer between their storages", "use zero_stage = 0 (plain data parallelism)")
    if p.recompute != "none":
        return (f"parallel.recompute = {p.recompute!r}", "recomputation re-runs a forward inside backward, where "
                "it would read the newest weights instead of the version its micro-batch used", "set recompute = 'none'")
    if t.precision == "fp16":
        return ("train.precision = 'fp16'", "a loss-scale overflow skips a step whose successor's forwards already "
                "ran on the stage", "use bf16 or fp32")
    if m.n_experts > 0 or p.ep > 1:
        return (f"model.n_experts = {m.n_experts}, parallel.ep = {p.ep}", "MoE layers count each step's expert load "
                "and auxiliary loss in their forwards, and 2BW runs the next step's first forwards inside this step",
                "use a dense model or another schedule")
    return None


@rule("pp-2bw-composition")
def _two_bw_composition(cfg: Config, world: int | None) -> str | None:
    if cfg.parallel.pipeline_schedule != "2bw" or (conflict := _two_bw_conflict(cfg)) is None:
        return None
    value, why, fix = conflict
    return f"parallel.pipeline_schedule = '2bw' with {value} is not supported: {why}; {fix}"


@rule("cp-zigzag-seq-len")
def _cp_seq(cfg: Config, world: int | None) -> str | None:
    p, t = cfg.parallel, cfg.train
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        return (f"train.seq_len = {t.seq_len} is not divisible by 2 * parallel.cp = {2 * p.cp} "
                f"(zigzag causal load balancing); use a multiple of {2 * p.cp}")
    return None


@rule("sp-seq-len")
def _sp_seq(cfg: Config, world: int | None) -> str | None:
    p, t = cfg.parallel, cfg.train
    if p.sequence_parallel and p.tp > 1:
        split = p.tp * (2 * p.cp if p.cp > 1 else 1)
        if t.seq_len % split:
            return (f"train.seq_len = {t.seq_len} is not divisible by {split} (sequence parallelism splits each "
                    f"sequence{' chunk' if p.cp > 1 else ''} across parallel.tp = {p.tp}); use a multiple of {split}")
    return None


@rule("world-size")
def _world(cfg: Config, world: int | None) -> str | None:
    p = cfg.parallel
    if world is not None and world != p.world_size:
        return (f"world size {world} != dp * tp * pp * cp = {p.dp} * {p.tp} * {p.pp} * {p.cp} = {p.world_size}; "
                f"launch {p.world_size} processes (--nproc {p.world_size}) or change the layout")
    return None


@rule("offload-needs-zero")
def _offload(cfg: Config, world: int | None) -> str | None:
    p = cfg.parallel
    if p.offload_optimizer and p.zero_stage < 1:
        return (f"parallel.offload_optimizer = true needs parallel.zero_stage >= 1 (got {p.zero_stage}); "
                "set zero_stage to 1, 2 or 3 or turn offload off")
    if p.offload_to == "disk" and not p.offload_optimizer:
        return ("parallel.offload_to = 'disk' places the offloaded optimizer state, but parallel.offload_optimizer "
                "= false; set offload_optimizer = true (and zero_stage >= 1)")
    if p.offload_params and (p.zero_stage != 3 or not p.offload_optimizer):
        return (f"parallel.offload_params = true needs parallel.zero_stage = 3 (got {p.zero_stage}) and "
                f"parallel.offload_optimizer = true (got {str(p.offload_optimizer).lower()}): the update runs where "
                "the parameter shards live")
    return None


@rule("dp-compression")
def _compression(cfg: Config, world: int | None) -> str | None:
    p = cfg.parallel
    if p.grad_compression in ("bf16", "fp16") and p.zero_stage < 1:
        return (f"parallel.grad_compression = {p.grad_compression!r} needs parallel.zero_stage >= 1 (got "
                f"{p.zero_stage}); set zero_stage to 1, 2 or 3, or use grad_compression = 'int8' (any stage)")
    if p.grad_compression != "none" and p.hierarchical_dp:
        return (f"parallel.grad_compression = {p.grad_compression!r} with parallel.hierarchical_dp = true is not "
                "supported; turn one of them off")
    return None


@rule("zero3-pp-experts")
def _zero3_pp_experts(cfg: Config, world: int | None) -> str | None:
    # ZeRO-3 under pp gathers each stage's parameters once per step (parallel/zero3.py,
    # StageSharded); the routed experts' own ZeRO-3 (over dp x cp / ep) still gathers per unit and
    # micro-batch with module hooks, which pipeline chunks do not drive.
    p = cfg.parallel
    if p.zero_stage == 3 and p.pp > 1 and p.ep > 1:
        return (f"parallel.zero_stage = 3 with parallel.pp = {p.pp} and parallel.ep = {p.ep} is not supported: the "
                "routed experts' ZeRO-3 shards are not gathered per pipeline stage; use parallel.ep = 1, or "
                "parallel.zero_stage = 1 or 2")
    return None


# ----------------------------------------------------------------------------- families


def _first_of(prefix: str, model: ModelConfig, tp: int = 1) -> str | None:
    from hybridpar.config import Config, ParallelConfig

    return _first_named((prefix,), Config(model=model, parallel=ParallelConfig(tp=tp)))


def schedule_error(schedule: str, pp: int, virtual_stages: int, microbatches: int) -> str | None:
    """The message of the first pipeline-schedule rule (``virtual-*``, ``interleaved-*``, ``pp-2bw-microbatches``) that
    ``microbatches`` micro-batches on ``pp`` ranks x ``virtual_stages`` break, or None: what
    :func:`hybridpar.parallel.pipeline.build_schedule` checks."""
    from hybridpar.config import Config, ParallelConfig, TrainConfig

    cfg = Config(parallel=ParallelConfig(pp=pp, virtual_stages=virtual_stages, pipeline_schedule=schedule),
                 train=TrainConfig(global_batch=microbatches, micro_batch=1))
    return _first_named(("virtual-", "interleaved-", "pp-2bw-microbatches"), cfg)


def partition_error(n_layers: int, pp: int, virtual_stages: int) -> str | None:
    """The message of the layer-per-chunk rule for ``n_layers`` on ``pp * virtual_stages``
    chunks, or None: what the pipeline partitioner checks."""
    from hybridpar.config import Config, ModelConfig, ParallelConfig

    cfg = Config(model=ModelConfig(n_layers=n_layers), parallel=ParallelConfig(pp=pp, virtual_stages=virtual_stages))
    return _first_named(("pp-layer-per-chunk",), cfg)


def _first_named(prefixes: tuple[str, ...], cfg: Config) -> str | None:
    for r in RULES:
        if r.name.startswith(prefixes) and (message := r.check(cfg, None)) is not None:
            return message
    return None


def tp_split_error(model: ModelConfig, tp: int) -> str | None:
    """The message of the first ``tp-*`` rule that splitting ``model`` ``tp`` ways breaks, or
    None: what a family's tensor-parallel plan checks before it splits."""
    return _first_of("tp-", model, tp)


def model_error(model: ModelConfig) -> str | None:
    """The message of the first ``model-*`` rule ``model`` breaks, or None: what a family's
    model checks when it is built outside a validated run."""
    return _first_of("model-", model)
