"""The layout rules: how the batch, the heads, the experts, the layers and the sequence divide
over the mesh axes, which schedules and ZeRO features compose, and the world size."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridpar.rules.base import (
    PIPELINE_CHECKS,
    TP_CHECKS,
    PipelineShape,
    first_message,
    pipeline_rule,
    rule,
    tp_rule,
)

if TYPE_CHECKING:
    from hybridpar.config import Config, ModelConfig


@rule("dp-divides-batch")
def _dp_batch(cfg: Config, world: int | None) -> str | None:
    p, t = cfg.parallel, cfg.train
    if t.global_batch % (p.dp * t.micro_batch):
        return (f"train.global_batch = {t.global_batch} is not divisible by parallel.dp * train.micro_batch = "
                f"{p.dp} * {t.micro_batch} = {p.dp * t.micro_batch}; make global_batch a multiple of "
                f"{p.dp * t.micro_batch}")
    return None


@tp_rule("tp-whole-kv-heads")
def _tp_kv_whole(m: ModelConfig, tp: int) -> str | None:
    if m.n_kv_heads < tp:
        return (f"model.n_kv_heads = {m.n_kv_heads} < parallel.tp = {tp}: every tp rank needs a whole KV head "
                f"(KV-head replication is not supported); use tp <= {m.n_kv_heads}")
    return None


@tp_rule("tp-divides-heads")
def _tp_heads(m: ModelConfig, tp: int) -> str | None:
    if m.n_heads % tp:
        return f"model.n_heads = {m.n_heads} is not divisible by parallel.tp = {tp}; use a tp that divides {m.n_heads}"
    return None


@tp_rule("tp-divides-kv-heads")
def _tp_kv(m: ModelConfig, tp: int) -> str | None:
    if m.n_kv_heads % tp:
        return (f"model.n_kv_heads = {m.n_kv_heads} is not divisible by parallel.tp = {tp}; use tp <= "
                f"{m.n_kv_heads} that divides it")
    return None


@tp_rule("tp-divides-ffn")
def _tp_ffn(m: ModelConfig, tp: int) -> str | None:
    if m.ffn_hidden % tp:
        return f"model.ffn_hidden = {m.ffn_hidden} is not divisible by parallel.tp = {tp}; use a tp that divides it"
    return None


@tp_rule("tp-divides-expert-ffn")
def _tp_expert_ffn(m: ModelConfig, tp: int) -> str | None:
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


@rule("dp-shard-divides-dp-cp")
def _dp_shard(cfg: Config, world: int | None) -> str | None:
    p = cfg.parallel
    n = p.dp * p.cp
    if p.dp_shard == 0 or p.dp_shard == n:
        return None
    divisors = [d for d in range(2, n + 1) if n % d == 0]
    if p.dp_shard < 0:
        return f"parallel.dp_shard = {p.dp_shard} must be >= 0 (0: shard over all dp * cp = {n} ranks)"
    if n == 1:
        return (f"parallel.dp_shard = {p.dp_shard} has nothing to shard over: parallel.dp * parallel.cp = "
                f"{p.dp} * {p.cp} = 1; raise dp (or cp), or leave dp_shard = 0")
    if n % p.dp_shard:
        return (f"parallel.dp_shard = {p.dp_shard} does not divide parallel.dp * parallel.cp = {p.dp} * {p.cp} = {n} "
                f"(the ZeRO groups are runs of dp_shard of those ranks); use one of {divisors} or 0 (all {n})")
    if p.zero_stage == 0:
        return (f"parallel.dp_shard = {p.dp_shard} with parallel.zero_stage = 0 means nothing: stage 0 shards "
                "nothing, every rank holds everything; set zero_stage to 1, 2 or 3 (hybrid sharding) or dp_shard = 0")
    if p.dp_shard == 1:
        return (f"parallel.dp_shard = 1 shards nothing: ZeRO groups of one rank are plain data parallelism over all "
                f"{n} ranks; use zero_stage = 0, or dp_shard in {divisors}")
    if p.ep > 1 and p.dp_shard % p.ep and p.ep % p.dp_shard:
        return (f"parallel.ep = {p.ep} and parallel.dp_shard = {p.dp_shard} do not nest (the experts shard over "
                "the ep runs inside one ZeRO group); make one divide the other")
    return None


def partition_error(n_layers: int, pp: int, virtual_stages: int) -> str | None:
    """The message of the layer-per-chunk rule for ``n_layers`` on ``pp * virtual_stages``
    chunks, or None: what the pipeline partitioner checks."""
    stages = pp * virtual_stages
    if n_layers < stages:
        return (f"model.n_layers = {n_layers} < parallel.pp * virtual_stages = {pp} * {virtual_stages} = "
                f"{stages} pipeline chunks; every chunk needs a layer: lower pp or virtual_stages, or add layers")
    return None


@rule("pp-layer-per-chunk")
def _pp_layers(cfg: Config, world: int | None) -> str | None:
    return partition_error(cfg.model.n_layers, cfg.parallel.pp, cfg.parallel.virtual_stages)


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


@pipeline_rule("virtual-stages-need-interleaved")
def _virtual(s: PipelineShape) -> str | None:
    if s.virtual_stages != 1 and s.pipeline_schedule not in ("interleaved", "zbv"):
        return (f"parallel.virtual_stages = {s.virtual_stages} needs parallel.pipeline_schedule = 'interleaved' "
                f"(or 'zbv' with 2), not {s.pipeline_schedule!r}; or set virtual_stages = 1")
    return None


@pipeline_rule("virtual-stages-zbv")
def _zbv(s: PipelineShape) -> str | None:
    if s.pipeline_schedule == "zbv" and s.virtual_stages != 2:
        return (f"parallel.pipeline_schedule = 'zbv' needs parallel.virtual_stages = 2 (two chunks per rank "
                f"placed as a V), got {s.virtual_stages}; set virtual_stages = 2")
    return None


@pipeline_rule("interleaved-needs-pp")
def _interleaved_pp(s: PipelineShape) -> str | None:
    if s.pipeline_schedule == "interleaved" and s.virtual_stages > 1 and s.pp < 2:
        return (f"parallel.pipeline_schedule = 'interleaved' with parallel.virtual_stages = {s.virtual_stages} "
                f"needs parallel.pp >= 2 (got {s.pp}); set virtual_stages = 1 without pipelining")
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


@pipeline_rule("interleaved-microbatches-divisible")
def _interleaved(s: PipelineShape) -> str | None:
    micro = s.microbatches
    rem = micro % s.pp
    if s.pipeline_schedule == "interleaved" and rem:
        down, up = micro - rem, micro - rem + s.pp
        fix = f"{down} or {up}" if down >= s.pp else f"{up}"
        return (f"interleaved 1F1B needs micro-batches per step divisible by parallel.pp: {micro} % {s.pp} = "
                f"{rem}; use {fix} micro-batches (train.global_batch / (dp * train.micro_batch))")
    return None


@pipeline_rule("pp-2bw-microbatches")
def _two_bw_microbatches(s: PipelineShape) -> str | None:
    if s.pipeline_schedule != "2bw":
        return None
    if s.pp < 2:
        return (f"parallel.pipeline_schedule = '2bw' needs parallel.pp >= 2 (got {s.pp}): PipeDream-2BW overlaps "
                "consecutive steps across pipeline stages; raise pp or use pipeline_schedule = '1f1b'")
    micro = s.microbatches
    if micro < s.pp:
        return (f"PipeDream-2BW needs at least parallel.pp = {s.pp} micro-batches per step, got train.global_batch / "
                f"(dp * train.micro_batch) = {s.global_batch} / ({s.dp} * {s.micro_batch}) = {micro}; raise "
                f"global_batch to {s.pp * s.dp * s.micro_batch} or lower micro_batch")
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


@rule("cp-ulysses-degree")
def _cp_ulysses(cfg: Config, world: int | None) -> str | None:
    p = cfg.parallel
    if p.cp_mode != "hybrid":
        if p.cp_ulysses:
            return (f"parallel.cp_ulysses = {p.cp_ulysses} is read only with parallel.cp_mode = 'hybrid' (got "
                    f"{p.cp_mode!r}); set cp_mode = 'hybrid' or leave cp_ulysses = 0")
        return None
    if p.cp_ulysses < 2 or p.cp % p.cp_ulysses:
        return (f"parallel.cp_mode = 'hybrid' needs parallel.cp_ulysses >= 2 dividing parallel.cp = {p.cp} (the "
                f"Ulysses ranks inside each ring position), got {p.cp_ulysses}; use a divisor of {p.cp} such as "
                f"{min([d for d in range(2, p.cp + 1) if p.cp % d == 0] or [p.cp])}")
    return None


def ulysses_error(model: ModelConfig, tp: int, u: int, cp_mode: str) -> str | None:
    """The message of rule ``cp-ulysses-heads`` for Ulysses degree ``u`` (the heads left
    per tp rank split into ``u`` whole groups; KV heads split too, or replicated ``u / kv``
    ways), or None: what the planner asks before it proposes a cp mode."""
    heads, kv = model.n_heads // tp, model.n_kv_heads // tp
    if u == 1:
        return None
    if heads % u:
        return (f"model.n_heads = {model.n_heads} over parallel.tp = {tp} leaves {heads} heads per tp rank, not "
                f"divisible by the Ulysses degree {u} (parallel.cp_mode = {cp_mode!r}); Ulysses gives every rank "
                f"whole heads: use a Ulysses degree that divides {heads}, or cp_mode = 'ring'")
    if kv % u and u % kv:
        return (f"model.n_kv_heads = {model.n_kv_heads} over parallel.tp = {tp} leaves {kv} KV heads per tp rank: "
                f"the Ulysses degree {u} must divide them or be a multiple of them (then KV heads are "
                f"replicated {u} / {kv} ways); use a Ulysses degree that divides {kv} or a multiple of {kv}, "
                "or cp_mode = 'ring'")
    return None


@rule("cp-ulysses-heads")
def _ulysses_heads(cfg: Config, world: int | None) -> str | None:
    p = cfg.parallel
    return ulysses_error(cfg.model, p.tp, p.cp_split()[0], p.cp_mode)


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
        unmet = [f"parallel.zero_stage = 3 (got {p.zero_stage})"] if p.zero_stage != 3 else []
        unmet += ["parallel.offload_optimizer = true (got false)"] if not p.offload_optimizer else []
        return (f"parallel.offload_params = true needs {' and '.join(unmet)}: the update runs where the "
                "parameter shards live")
    return None


@rule("offload-activations-fraction")
def _offload_activations(cfg: Config, world: int | None) -> str | None:
    p = cfg.parallel
    f = p.offload_activations_fraction
    if not 0 < f <= 1:
        return (f"parallel.offload_activations_fraction = {f} must be in (0, 1]: the share of each pipeline chunk's "
                "blocks whose saved activations go to host memory; use 1 for all of them")
    if f != 1 and not p.offload_activations:
        return (f"parallel.offload_activations_fraction = {f} has no effect with parallel.offload_activations = "
                "false; set offload_activations = true (or leave the fraction at 1)")
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
    # ZeRO-3 under pp gathers each stage's parameters once per step (parallel/zero/zero3_pp.py,
    # StageSharded); the routed experts' own ZeRO-3 (over dp x cp / ep) still gathers per unit and
    # micro-batch with module hooks, which pipeline chunks do not drive.
    p = cfg.parallel
    if p.zero_stage == 3 and p.pp > 1 and p.ep > 1:
        return (f"parallel.zero_stage = 3 with parallel.pp = {p.pp} and parallel.ep = {p.ep} is not supported: the "
                "routed experts' ZeRO-3 shards are not gathered per pipeline stage; use parallel.ep = 1, or "
                "parallel.zero_stage = 1 or 2")
    return None


def schedule_error(schedule: str, pp: int, virtual_stages: int, microbatches: int) -> str | None:
    """The message of the first pipeline-schedule rule (``virtual-*``, ``interleaved-*``,
    ``pp-2bw-microbatches``) that ``microbatches`` micro-batches on ``pp`` ranks x ``virtual_stages``
    break, or None: what :func:`hybridpar.parallel.pipeline.build_schedule` checks."""
    shape = PipelineShape(schedule, pp, virtual_stages, microbatches, dp=1, global_batch=microbatches, micro_batch=1)
    return first_message(PIPELINE_CHECKS, shape)


def tp_split_error(model: ModelConfig, tp: int) -> str | None:
    """The message of the first ``tp-*`` rule that splitting ``model`` ``tp`` ways breaks, or
    None: what a family's tensor-parallel plan checks before it splits."""
    return first_message(TP_CHECKS, model, tp)
