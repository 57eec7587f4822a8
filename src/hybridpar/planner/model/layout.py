"""What the planner evaluates: a layout (the ``parallel.*`` settings plus ``micro_batch``) and a
workload (batch, sequence, precision, block style), and the bridge to
:func:`hybridpar.config.validate`.

The planner owns no layout rules: :func:`layout_rule` builds a real :class:`Config` and asks
the rules which one it breaks (a :class:`~hybridpar.rules.Broken`: the rule, by name, and its
message). Combinations the runtime refuses (such as ZeRO-3 with pipelining) are still
planned, since the planner also answers "what would it take"; :func:`runtime_note` says when a
layout cannot run in this version.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import operator
from dataclasses import dataclass

from hybridpar.config import (
    Config,
    ConfigError,
    Fp8Config,
    LayoutChoice,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)
from hybridpar.planner.model.moe import DEFAULT_IMBALANCE
from hybridpar.planner.model.sac import check_selective_ac
from hybridpar.rules import Broken, first_broken, fp8_gathers

LAYOUT_KEYS = (*(f.name for f in dataclasses.fields(LayoutChoice)), "micro_batch")


@dataclass(unsafe_hash=True)
class Layout(LayoutChoice):
    """One candidate: the layout fields of :class:`~hybridpar.config.LayoutChoice` (the same
    ones ``[parallel]`` has) plus ``micro_batch``. Hashable, as cache keys; never mutated (the
    planner derives new candidates with ``dataclasses.replace``)."""

    micro_batch: int = 1

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches per step on each pipeline (``parallel.microbatches``)."""
        return global_batch // (self.dp * self.micro_batch)

    def short(self) -> str:
        """``dp=8,tp=8,pp=2,cp=1`` (and ``,cp_mode=...`` for a cp other than ring, ``,ep=4`` with
        expert parallelism, ``,dp_shard=4`` with hybrid sharding), for messages."""
        cp = f",cp_mode={self.cp_mode}" + (f"x{self.cp_ulysses}" if self.cp_mode == "hybrid" else "") \
            if self.cp > 1 and self.cp_mode != "ring" else ""
        return (f"dp={self.dp},tp={self.tp},pp={self.pp},cp={self.cp}" + cp + (f",ep={self.ep}" if self.ep > 1 else "")
                + (f",dp_shard={self.dp_shard}" if self.dp_shard else ""))

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


class BlockStyle(enum.StrEnum):
    """Which implementation of the decoder block the cost and memory models price. The values
    are the names the planner's former ``style`` argument took, so JSON writes the same."""

    EAGER = "llama"
    """This runtime's eager Llama block (:class:`hybridpar.models.llama.Block`): separate q/k/v/o
    and w1/w3/w2 GEMMs, fused causal attention, unfused element-wise ops, activations as
    autograd saves them."""
    COMPILED = "llama-compiled"
    """The same block under ``train.compile``: the same GEMMs as ``EAGER``, element-wise ops fused
    by Inductor into a few passes and launched by its generated code
    (:mod:`hybridpar.planner.machine.efficiency`'s host floor), and the tensors Inductor's partitioner
    saves (:func:`hybridpar.planner.memory.activations.compiled_layer_bytes`)."""
    MEGATRON = "gpt"
    """Megatron-LM's fused GPT block: fused QKV, a 4h GELU MLP, unfused attention (scores,
    softmax, dropout), fused element-wise kernels, activations per Korthikanti et al. 2022."""


@dataclass(frozen=True)
class Workload:
    """Per-step work. ``half_params``: with bf16/fp16, parameters and gradients are stored in
    half precision and the optimizer keeps fp32 master weights (Megatron-LM, DeepSpeed); False
    is this runtime's autocast (fp32 parameters and gradients, half-precision matmuls).
    ``style``: the block implementation being planned (:class:`BlockStyle`; its value, such as
    ``"gpt"``, is accepted too). ``moe_imbalance``: max/mean tokens per expert of the routing
    being planned (mixture-of-experts models; :mod:`hybridpar.planner.model.moe`). ``selective_ac``:
    what ``recompute = "selective"`` means, ``"attention"`` (this runtime's: Korthikanti's
    attention-core recompute) or ``"op"`` (torchtitan's op-level policy, priced for published
    rows only; :mod:`hybridpar.planner.model.sac`)."""

    global_batch: int
    seq_len: int
    precision: str = "bf16"
    half_params: bool = True
    bucket_mb: float = 25.0
    style: BlockStyle = BlockStyle.EAGER
    moe_imbalance: float = DEFAULT_IMBALANCE
    loss_chunk_tokens: int = TrainConfig.loss_chunk_tokens  # the chunked loss (hybridpar.parallel.loss)
    fp8: str = "none"  # fp8.recipe: the blocks' linear GEMMs in FP8 (planner/price/fp8.py)
    fp8_all_gather: bool = False  # fp8.all_gather: ZeRO-3 gathers the FP8 linears' weights in FP8
    selective_ac: str = "attention"
    #: the fraction of the MoE layers' expert-parallel all-to-alls hidden behind another micro-batch's
    #: compute: 0 in this runtime's schedules; 1 prices DeepSeek's DualPipe (published rows only)
    ep_overlap: float = 0.0

    def __post_init__(self) -> None:
        # "gpt" -> BlockStyle.MEGATRON (a ValueError naming the value for anything else)
        object.__setattr__(self, "style", BlockStyle(self.style))
        check_selective_ac(self.selective_ac)
        if self.selective_ac == "op" and self.style is BlockStyle.MEGATRON:
            raise ValueError("selective_ac 'op' is priced for the Llama block styles, not 'gpt'")

    @property
    def act_bytes(self) -> int:
        """Bytes per activation element (the matmul dtype)."""
        return 4 if self.precision == "fp32" else 2

    @property
    def param_bytes(self) -> int:
        return 2 if self.precision != "fp32" and self.half_params else 4


def to_config(model: ModelConfig, layout: Layout, work: Workload) -> Config:
    """The trainer's config for this plan (what ``hybridpar train`` would be given)."""
    fields = {k: getattr(layout, k) for k in LAYOUT_KEYS if k != "micro_batch"}
    par = ParallelConfig(**fields, microbatches=0, bucket_mb=work.bucket_mb)  # type: ignore[arg-type]
    train = TrainConfig(global_batch=work.global_batch, micro_batch=layout.micro_batch,
                        seq_len=work.seq_len, precision=work.precision,  # type: ignore[arg-type]
                        loss_chunk_tokens=work.loss_chunk_tokens)
    fp8 = Fp8Config(work.fp8, all_gather=fp8_gathers(work.fp8, work.fp8_all_gather, layout.zero_stage))
    return Config(model=dataclasses.replace(model), parallel=par, train=train, fp8=fp8)


ModelKey = tuple  # a model shape's field values, hashable: the key of cached results


def model_key(model: ModelConfig) -> ModelKey:
    """``model``'s current field values as a tuple (equal shapes, equal keys): the key of cached
    results (``ModelConfig`` itself is mutable, so not hashable). :func:`model_of` inverts it.
    Shallow (its fields are scalars and strings): the planner asks for it thousands of times."""
    return _model_fields(model)


#: :func:`model_key`'s reader: every field of ``ModelConfig`` in declaration order, in one C call
_model_fields = operator.attrgetter(*(f.name for f in dataclasses.fields(ModelConfig)))


def model_of(key: ModelKey) -> ModelConfig:
    """A fresh :class:`ModelConfig` with the field values of ``key``."""
    return ModelConfig(*key)


def num_params_of(model: ModelConfig) -> int:
    """``model.num_params()``, memoised per shape (the search prices thousands of candidates)."""
    return _num_params(model_key(model))


def flops_per_token_of(model: ModelConfig, seq_len: int) -> float:
    """``model.flops_per_token(seq_len)``, memoised per shape and length."""
    return _flops_per_token(model_key(model), seq_len)


@functools.lru_cache(maxsize=1024)
def _num_params(key: ModelKey) -> int:
    return model_of(key).num_params()


@functools.lru_cache(maxsize=1024)
def _flops_per_token(key: ModelKey, seq_len: int) -> float:
    return model_of(key).flops_per_token(seq_len)


def layout_rule(model: ModelConfig, layout: Layout, work: Workload) -> Broken | None:
    """The layout rule ``validate`` says this layout breaks, with its message (None if it breaks
    none), judging only shapes and divisibility: ZeRO (and its dp_shard), offload, recompute and
    compression are switched off for this check."""
    if layout.zero_stage or layout.offload_optimizer or layout.recompute != "none" or layout.grad_compression != "none" \
            or layout.dp_shard:
        layout = dataclasses.replace(layout, zero_stage=0, offload_optimizer=False, recompute="none",
                                     grad_compression="none", offload_to="cpu", offload_params=False, dp_shard=0)
    return _broken(model_key(model), layout, work)


def layout_rule_error(model: ModelConfig, layout: Layout, work: Workload) -> str | None:
    """The message of :func:`layout_rule` (None if the layout breaks no rule)."""
    broken = layout_rule(model, layout, work)
    return None if broken is None else broken.message


def runtime_note(model: ModelConfig, layout: Layout, work: Workload) -> str | None:
    """Why this version's trainer would refuse the layout (a feature not built yet, or a
    ``runtime-*`` rule: a limit of this runtime, not of the layout), else None. ``hybridpar
    plan`` ranks only layouts without a note (:func:`hybridpar.planner.search.search.search`'s
    ``runnable_top``), so it never recommends first a layout ``train`` refuses."""
    key = model_key(model)
    broken = _broken(key, layout, work) or _runtime_broken(key, layout, work)
    return None if broken is None else broken.message


@functools.lru_cache(maxsize=16384)
def _broken(key: ModelKey, layout: Layout, work: Workload) -> Broken | None:
    # runtime-* rules: what this runtime cannot run yet but the layout's cost model prices; the search
    # prices such layouts (the "what would it take" answers, published rows) and notes them (runtime_note)
    return first_broken(to_config(model_of(key), layout, work), layout.world_size, skip=("runtime-",))


@functools.lru_cache(maxsize=16384)
def _runtime_broken(key: ModelKey, layout: Layout, work: Workload) -> Broken | None:
    return first_broken(to_config(model_of(key), layout, work), layout.world_size, only=("runtime-",))


def parse_layout(text: str) -> dict[str, object]:
    """``"dp=8,tp=8,pp=16,cp=1"`` -> ``{"dp": 8, ...}``; keys are ``parallel.*`` names (with or
    without the ``parallel.`` prefix) plus ``micro_batch``; values typed like Layout's fields."""
    types = {f.name: f.type for f in dataclasses.fields(Layout)}
    out: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().removeprefix("parallel.").removeprefix("train.")
        if not sep or key not in types:
            raise ConfigError(f"--layout item {part!r}: expected key=value with key one of {list(LAYOUT_KEYS)}")
        value = value.strip()
        kind = types[key]
        if kind == "int":
            try:
                out[key] = int(value)
            except ValueError:
                raise ConfigError(f"--layout {key}={value!r} must be an integer") from None
        elif kind == "float":
            try:
                out[key] = float(value)
            except ValueError:
                raise ConfigError(f"--layout {key}={value!r} must be a number") from None
        elif kind == "bool":
            if value.lower() not in ("true", "false", "1", "0"):
                raise ConfigError(f"--layout {key}={value!r} must be true or false")
            out[key] = value.lower() in ("true", "1")
        else:
            out[key] = value
    return out


def from_config(cfg: Config) -> tuple[Layout, Workload]:
    """The planner's view of a trainer config: its layout and workload (the inverse of
    :func:`to_config`; the runtime keeps fp32 parameters, so ``half_params`` is False, and runs
    the eager block, the default ``style``)."""
    p, t = cfg.parallel, cfg.train
    fields = {k: getattr(p, k) for k in LAYOUT_KEYS if k != "micro_batch"}
    layout = Layout(**fields, micro_batch=t.micro_batch)  # type: ignore[arg-type]
    work = Workload(t.global_batch, t.seq_len, t.precision, half_params=False, bucket_mb=p.bucket_mb,
                    loss_chunk_tokens=t.loss_chunk_tokens, fp8=cfg.fp8.recipe, fp8_all_gather=cfg.fp8.all_gather)
    return layout, work
