"""Typed settings for a run: model shape, parallel layout, training recipe.

TOML in, validated dataclasses out. Every layout rule lives in :mod:`hybridpar.rules`; :func:`validate`
applies them before any process group exists, so a bad config is one clear ``ValueError`` instead of a hang.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from hybridpar.errors import UserError
from hybridpar.presets import MODEL_PRESETS
from hybridpar.rules import first_broken

Precision = Literal["fp32", "bf16", "fp16"]
Schedule = Literal["gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "2bw"]
Recompute = Literal["none", "selective", "full"]
GradCompression = Literal["none", "bf16", "fp16", "int8"]
OffloadTarget = Literal["cpu", "disk"]
CpMode = Literal["ring", "ulysses", "hybrid"]
RouterScore = Literal["softmax", "sigmoid"]


class ConfigError(UserError):
    """A config value is wrong; the message names the key, the value and the fix."""


@dataclass
class ModelConfig:
    """A decoder's shape. ``family`` names its folder under ``hybridpar.models`` (``llama``,
    ``qwen2``, ``qwen3``, ``mistral``, ``mixtral``, ``qwen3_moe``, ``gpt2``); ``preset`` names the
    published shape the others started from. ``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3) and
    ``kv_channels`` (a head size other than ``dim / n_heads``, 0 = that) are the features some
    families add to Llama's."""

    preset: str = "tiny"
    family: str = "llama"
    dim: int = 128
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_hidden: int = 384
    vocab_size: int = 256
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    # RoPE scaling as transformers' rope_type and parameters (see hybridpar.models.rope)
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_len: int = 0  # the pretraining length (0 = max_seq_len)
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float = 0.0
    rope_truncate: bool = True
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    kv_channels: int = 0
    # Mixture of experts (``n_experts`` 0: dense). Routed experts are SwiGLU MLPs of
    # ``moe_ffn_hidden`` (0: ``ffn_hidden``); ``n_shared_experts`` of them run on every token.
    n_experts: int = 0
    experts_per_token: int = 2
    n_shared_experts: int = 0
    moe_ffn_hidden: int = 0
    moe_layers: str = ""  # which layers are MoE: "" = all, else e.g. "1,3,5" (the others dense)
    router_score: RouterScore = "softmax"
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to 1
    aux_loss_coef: float = 0.01  # load-balancing loss (Switch / GShard) per MoE layer
    z_loss_coef: float = 0.0  # router z-loss (ST-MoE) per MoE layer
    bias_update_rate: float = 0.0  # > 0: DeepSeek-V3's auxiliary-loss-free balancing bias, this step size
    # DeepSeek-V3 (family deepseek_v3, see hybridpar.models.deepseek_v3): multi-head latent attention
    # (q_lora_rank 0 = a full query projection), group-limited routing, the sequence-wise balance loss and
    # mtp_layers multi-token prediction modules, their losses weighted mtp_loss_weight / mtp_layers
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the rope channels of q and k stored as interleaved pairs (DeepSeek's)
    rope_mscale_all_dim: float = 0.0  # yarn: softmax scale x (0.1 mscale_all_dim ln(factor) + 1)^2
    n_group: int = 1  # experts in n_group groups; a token routes within its topk_group best groups
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights x this
    seq_aux_loss_coef: float = 0.0  # DeepSeek-V3's sequence-wise balance loss per MoE layer
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.3

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.dim // self.n_heads

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3) instead of q/k/v projections."""
        return self.kv_lora_rank > 0

    @property
    def expert_hidden(self) -> int:
        """Hidden size of one routed (or shared) expert."""
        return self.moe_ffn_hidden or self.ffn_hidden

    def moe_layer_ids(self) -> tuple[int, ...]:
        """Indices of the MoE layers (none for a dense model)."""
        return _moe_layer_ids(self.n_experts, self.n_layers, self.moe_layers)

    def _ffn_params(self, layer: int) -> int:
        if layer not in self.moe_layer_ids():
            return 3 * self.dim * self.ffn_hidden
        routed = self.n_experts * 3 * self.dim * self.expert_hidden
        return routed + self.n_experts * self.dim + self.n_shared_experts * 3 * self.dim * self.expert_hidden

    def active_ffn_params(self, layer: int) -> int:
        """Parameters one token's FFN uses in ``layer`` (top-k routed + shared experts + router)."""
        if layer not in self.moe_layer_ids():
            return 3 * self.dim * self.ffn_hidden
        used = (self.experts_per_token + self.n_shared_experts) * 3 * self.dim * self.expert_hidden
        return used + self.n_experts * self.dim

    def mla_params(self) -> int:
        """Parameters of one multi-head latent attention: the query (low-rank with its norm, or
        full), the compressed key/value with the shared rope key and its norm, their up-projection
        and the output projection."""
        h, qk = self.n_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
        q = self.q_lora_rank * (self.dim + 1 + h * qk) if self.q_lora_rank else self.dim * h * qk
        kv = self.dim * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        return q + kv + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim) + h * self.v_head_dim * self.dim

    def layer_params(self) -> int:
        """Exact parameter count of one decoder layer of this family."""
        if self.mla:
            return self.mla_params() + 3 * self.dim * self.ffn_hidden + 2 * self.dim
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = 2 * self.dim * q_dim + 2 * self.dim * kv_dim
        if self.family == "gpt2":  # LayerNorms with bias, a 2-matrix GELU MLP, biases everywhere
            return attn + (q_dim + 2 * kv_dim + self.dim) + 2 * self.dim * self.ffn_hidden \
                + self.ffn_hidden + self.dim + 4 * self.dim
        attn += (q_dim + 2 * kv_dim) if self.qkv_bias else 0
        attn += 2 * self.head_dim if self.qk_norm else 0
        return attn + 3 * self.dim * self.ffn_hidden + 2 * self.dim

    def num_params(self) -> int:
        """Exact parameter count of this family's model for this shape (every expert counted)."""
        embed = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        final_norm = 2 * self.dim if self.family == "gpt2" else self.dim
        positions = self.max_seq_len * self.dim if self.family == "gpt2" else 0
        moe = sum(self._ffn_params(i) - 3 * self.dim * self.ffn_hidden for i in self.moe_layer_ids())
        return self.n_layers * self.layer_params() + moe + embed + head + final_norm + positions + self.mtp_params()

    def mtp_params(self) -> int:
        """Parameters of the multi-token prediction modules (embedding and head shared with the
        model): per module two input norms, the ``[2 dim -> dim]`` projection, a decoder layer
        (MoE when the model has experts) and its output norm."""
        if not self.mtp_layers:
            return 0
        moe = self._ffn_params(self.moe_layer_ids()[0]) - 3 * self.dim * self.ffn_hidden if self.n_experts else 0
        return self.mtp_layers * (3 * self.dim + 2 * self.dim * self.dim + self.layer_params() + moe)

    def layer_flops(self, layer: int, seq_len: int) -> float:
        """Training FLOPs per token of decoder layer ``layer``: 6 x its matmul parameters a token
        uses (an MoE layer's routed + shared experts and router, not all experts) + 12 x dim x
        seq_len for the attention scores (forward + backward = 3x forward, PaLM appendix B)."""
        if self.mla:  # scores over qk_nope + qk_rope channels, values of v_head_dim, per head
            scores = 6.0 * self.n_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim) * seq_len
            matmuls = self.mla_params() - self.q_lora_rank - self.kv_lora_rank  # less the two norms
            return 6.0 * (matmuls + self.active_ffn_params(layer)) + scores
        attn = 2 * self.dim * self.n_heads * self.head_dim + 2 * self.dim * self.n_kv_heads * self.head_dim
        mlp = (2 * self.dim * self.ffn_hidden if self.family == "gpt2" else self.active_ffn_params(layer))
        return 6.0 * (attn + mlp) + 12.0 * self.dim * seq_len

    def head_flops(self) -> float:
        """Training FLOPs per token of the output head (a matmul, tied or not); the embedding
        lookup is none."""
        return 6.0 * self.vocab_size * self.dim

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x matmul parameters + 12 x n_layers x dim x seq_len, the sum
        of :meth:`layer_flops` over the layers and :meth:`head_flops`. Attention scores count in
        full, as in PaLM."""
        return sum(self.layer_flops(i, seq_len) for i in range(self.n_layers)) + self.head_flops() \
            + self.mtp_flops(seq_len)

    def mtp_flops(self, seq_len: int) -> float:
        """Training FLOPs per token of the multi-token prediction modules: per module its
        ``[2 dim -> dim]`` projection, its decoder layer (as the last layer) and the shared head."""
        last = self.n_layers - 1
        return self.mtp_layers * (12.0 * self.dim * self.dim + self.layer_flops(last, seq_len) + self.head_flops())


@functools.lru_cache(maxsize=1024)
def _moe_layer_ids(n_experts: int, n_layers: int, moe_layers: str) -> tuple[int, ...]:
    """:meth:`ModelConfig.moe_layer_ids`, parsed once per value: the planner asks it per layer of
    every layout it prices (DeepSeek-V3 names 58 layers)."""
    if n_experts == 0:
        return ()
    if not moe_layers.strip():
        return tuple(range(n_layers))
    return tuple(sorted({int(x) for x in moe_layers.split(",") if x.strip()}))


def model_preset(name: str) -> ModelConfig:
    """The named published shape; raises naming the known presets."""
    if name not in MODEL_PRESETS:
        raise ConfigError(f"model.preset = {name!r} is unknown; choose one of {sorted(MODEL_PRESETS)}")
    return ModelConfig(preset=name, **MODEL_PRESETS[name])


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
    (:class:`hybridpar.planner.layout.Layout`) the micro-batch size."""

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
    fp8_all_gather: bool = False  # ZeRO-3, train.fp8 tensorwise: FP8 linears' weights gathered as e4m3 (zero/fp8_gather.py)

    def layer_counts(self) -> list[int] | None:
        """``stage_layers`` as integers (None when unset); ValueError when it is not a list of ints."""
        if not self.stage_layers.strip():
            return None
        return [int(x) for x in self.stage_layers.split(",")]


@dataclass
class TrainConfig:
    """The recipe. Batch sizes count sequences; ``global_batch`` is per optimizer step."""

    steps: int = 300
    global_batch: int = 16
    micro_batch: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 30
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    precision: Precision = "fp32"
    seed: int = 1234
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    checkpoint_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 0  # keep the newest K complete checkpoints, delete older ones; 0 = keep all
    async_checkpoint: bool = False  # copy checkpoints to host memory and write them in a background thread
    compile: bool = False  # torch.compile each transformer block (regional compilation)
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"  # aot_eager: traced graphs, eager kernels
    # the optimizer's kernel: auto (torch's fused Adam/AdamW/SGD where the device and dtype support it),
    # fused, foreach or for-loop (checked by the rule train-optimizer-impl)
    optimizer_impl: str = "auto"
    run_dir: str = "runs/default"
    data: str = "builtin"
    sample_tokens: int = 200
    sample_prompt: str = "def "  # the text sample.txt continues
    device: Literal["auto", "cpu", "cuda"] = "auto"
    loss_scale_init: float = 65536.0  # fp16 dynamic loss scale: start value
    loss_scale_window: int = 200  # fp16: clean steps before the scale doubles
    nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/Inf loss stops the run, or skips the step
    max_skipped_steps: int = 10  # with nonfinite = "skip": stop after this many skipped steps
    timeout_s: float = 300.0  # a collective or p2p that takes longer ends the job with a report
    init_from: str = ""  # a Hugging Face Llama directory to start from; "" = random init from seed
    hardware: str = ""  # parallel.auto's device: a GPU name or calibrated profile; "" = the default profile
    auto_resume: bool = True  # when torchrun restarts the job, continue from the latest complete checkpoint
    document_mask: bool = False  # packed documents: attention stays within each document, RoPE restarts per document
    # the head and loss in chunks of this many tokens (per micro-batch and rank), so the whole fp32 logits
    # never exist; micro-batches of at most this many tokens are not chunked; 0 = never chunk
    loss_chunk_tokens: int = 4096
    # FP8 GEMMs in the blocks' linear layers: "none", "tensorwise" or "rowwise" scaling (rules train-fp8-*)
    fp8: str = "none"

    @property
    def grad_accum(self) -> int:
        """Micro-batches per rank per step (before pipeline splitting)."""
        return self.global_batch // self.micro_batch


@dataclass
class Config:
    model: ModelConfig = field(default_factory=lambda: model_preset("tiny"))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @property
    def microbatches(self) -> int:
        """Micro-batches per step on each data-parallel replica: each pipeline's M."""
        return self.train.global_batch // (self.parallel.dp * self.train.micro_batch)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- loading

_SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig}


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number"}


def _coerce(key: str, value: Any, hint: Any, from_cli: bool = False) -> Any:
    """Check ``value`` against the field's type hint; strings are parsed only from the command line."""
    if not from_cli and isinstance(value, str) and hint in (bool, int, float):
        raise ConfigError(f"{key} = {value!r} must be {_TYPE_WORDS[hint]} (write it without quotes)")
    origin = get_origin(hint)
    if origin is Literal:
        choices = get_args(hint)
        if value not in choices:
            raise ConfigError(f"{key} = {value!r} is not allowed; choose one of {list(choices)}")
        return value
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"unsupported union type for {key}")
    if hint is bool:
        if isinstance(value, str):
            low = value.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} = {value!r} must be true or false")
    if hint is int:
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} = {value!r} must be an integer")
    if hint is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        elif isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key} = {value!r} must be a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} = {value!r} must be a string")
    raise TypeError(f"unsupported type {hint} for {key}")


def _apply(cfg: Config, section: str, values: dict[str, Any], from_cli: bool = False) -> None:
    if section not in _SECTIONS:
        raise ConfigError(f"unknown config section [{section}]; known sections: {sorted(_SECTIONS)}")
    target = getattr(cfg, section)
    hints = typing.get_type_hints(type(target))
    names = {f.name for f in dataclasses.fields(target)}
    if section == "model" and "preset" in values:  # a preset replaces the shape, then keys refine it
        preset = _coerce("model.preset", values["preset"], str)
        if preset.startswith("hf:"):  # the label of a model read from a Hugging Face directory
            missing = sorted(names - set(values))
            if missing:  # a label, not a shape: only a full config (a checkpoint's) may name it
                raise ConfigError(f"model.preset = {preset!r} labels a model read from a Hugging Face directory "
                                  f"and has no shape (model.{missing[0]} is not given); start from the "
                                  "directory with --train.init_from DIR")
            target = ModelConfig(preset=preset)
        else:
            target = model_preset(preset)
        cfg.model = target
    for key, value in values.items():
        if key not in names:
            raise ConfigError(f"unknown config key {section}.{key}; known keys: {sorted(names)}")
        if section == "model" and key == "preset":
            continue
        setattr(target, key, _coerce(f"{section}.{key}", value, hints[key], from_cli))


def _apply_sections(cfg: Config, data: dict[str, Any], source: str) -> None:
    for section in data:
        if section not in _SECTIONS:
            raise ConfigError(f"unknown config section [{section}] in {source}; known sections: {sorted(_SECTIONS)}")
    for section in ("model", "parallel", "train"):  # model first: its preset resets the shape
        if section in data:
            if not isinstance(data[section], dict):
                raise ConfigError(f"{section} in {source} must be a [table]")
            _apply(cfg, section, data[section])


def parse_config(data: dict[str, Any], source: str = "config") -> Config:
    """The defaults with ``{"model": {...}, "parallel": {...}, "train": {...}}`` applied, with the
    same key and type checks as a TOML file, not yet validated (other spellings of the settings,
    such as :class:`hybridpar.api.engine.EngineConfig`, choose which rules apply)."""
    cfg = Config()
    _apply_sections(cfg, data, source)
    return cfg


def config_from_dict(data: dict[str, Any], source: str = "config") -> Config:
    """A validated Config from ``{"model": {...}, "parallel": {...}, "train": {...}}`` (e.g. a
    checkpoint's config.json), with the same key and type checks as a TOML file."""
    cfg = parse_config(data, source)
    validate(cfg)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                init_model: Callable[[str], ModelConfig] | None = None) -> Config:
    """Defaults, then the TOML file, then ``--section.key value`` overrides, then :func:`validate`
    of everything that does not need the world size.

    ``init_model(dir)`` reads the model (family and shape) of a ``train.init_from`` directory
    (``hybridpar.models.hf.model_config_from_hf``): the run's model is then that one, and a
    ``model.*`` key set explicitly (file or command line) that contradicts it is refused."""
    cfg = Config()
    explicit: set[str] = set()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass an existing TOML file to --config")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
        _apply_sections(cfg, data, str(path))
        explicit.update(data.get("model", {}) if isinstance(data.get("model"), dict) else {})
    pairs = parse_overrides(overrides or [])
    explicit.update(k.partition(".")[2] for k, _ in pairs if k.startswith("model."))
    presets = [(k, v) for k, v in pairs if k == "model.preset"]
    for key, value in presets + [(k, v) for k, v in pairs if k != "model.preset"]:
        section, _, name = key.partition(".")
        _apply(cfg, section, {name: value}, from_cli=True)
    if cfg.train.init_from and init_model is not None:
        cfg.model = _model_of_init_from(cfg.model, init_model(cfg.train.init_from), explicit, cfg.train.init_from)
    validate(cfg)
    return cfg


def _model_of_init_from(given: ModelConfig, found: ModelConfig, explicit: set[str], source: str) -> ModelConfig:
    """``found`` (the model of ``train.init_from``), unless a key set explicitly disagrees: then
    one error naming every such key with both values. A preset counts as setting its shape."""
    keys = set(explicit) - {"preset"}
    if "preset" in explicit:
        keys |= set(MODEL_PRESETS.get(given.preset, {}))
    diffs = [(k, getattr(given, k), getattr(found, k)) for k in sorted(keys)
             if hasattr(found, k) and getattr(given, k) != getattr(found, k)]
    if diffs:
        said = "; ".join(f"model.{k} = {a!r} was given but {source} has {b!r}" for k, a, b in diffs)
        raise ConfigError(f"train.init_from = {source!r} contradicts the configured model: {said}. The model "
                          f"comes from the directory's config.json: drop those model.* settings")
    return found


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """``["--train.steps", "50", "--parallel.dp=2"]`` -> ``[("train.steps", "50"), ...]``."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --train.steps 50")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} needs a value, e.g. {arg} 2")
            value = args[i + 1]
            i += 2
        out.append((key, value))
    return out


# ----------------------------------------------------------------------------- validation

# Parallelism implemented so far; the rest is rejected with a message saying so.


def config_warnings(cfg: Config) -> list[str]:
    """Settings that are allowed but do nothing or will be slow; the CLI prints them."""
    p = cfg.parallel
    out = []
    if p.sequence_parallel and p.tp == 1:
        out.append("parallel.sequence_parallel = true has no effect with parallel.tp = 1; ignored")
    micro = cfg.microbatches
    if p.pp > 1 and micro < p.pp:
        idle = (p.pp - 1) / (micro + p.pp - 1)
        out.append(f"{micro} micro-batches per step < parallel.pp = {p.pp}: the pipeline is bubble-dominated "
                   f"(about {100 * idle:.0f}% idle); use at least {p.pp}, ideally {4 * p.pp} or more")
    return out


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Every layout and shape rule (:data:`hybridpar.rules.RULES`, in order). Raises one
    ConfigError naming numbers and fix: the first broken rule's message."""
    broken = first_broken(cfg, world_size)
    if broken is not None:
        raise ConfigError(broken[1])
