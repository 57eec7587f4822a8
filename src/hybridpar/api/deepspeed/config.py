"""A DeepSpeed ``ds_config`` (dict or JSON file) read onto :class:`~hybridpar.api.engine.EngineConfig`.

The keys are those of :mod:`hybridpar.api.deepspeed.schema` (docs/howto/deepspeed.md is the table);
what they become:

* the three batch keys -> ``gradient_accumulation_steps`` and the micro-batch per rank (any two
  imply the third over the data-parallel size; inconsistent ones refused with the arithmetic);
* ``optimizer`` {Adam, AdamW, SGD} -> ``optimizer``/``lr``/``betas``/``eps``/``momentum`` and the
  groups' ``weight_decay`` (DeepSpeed's ``Adam`` is AdamW unless ``adam_w_mode`` is false; a
  missing ``weight_decay`` is the optimizer class's default, as DeepSpeed passes the params on);
* ``fp16``/``bf16`` -> ``precision`` and the loss-scale keys; ``gradient_clipping`` -> ``grad_clip``;
* ``zero_optimization`` -> ``zero_stage``, ``bucket_mb``, the offload keys, ``zero3_prefetch``;
* ``tensor_parallel.autotp_size`` -> ``tensor_parallel_size``; ``communication_data_type`` ->
  ``grad_compression``;
* ``scheduler``, ``steps_per_print``, ``tensorboard``: kept for the DeepSpeed engine itself.

``"auto"`` (what Hugging Face's Trainer leaves for itself to fill) takes the value that Trainer
writes with default ``TrainingArguments``, or for sizes the model's ``hidden_size`` as it does; a
value only a training run knows (``total_num_steps``) is refused. Everything runs before any
process group exists: the data-parallel size comes from ``WORLD_SIZE`` (or the given world).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridpar.api.deepspeed.schedules import check_schedule
from hybridpar.api.deepspeed.schema import check_keys, no_effect_keys
from hybridpar.api.engine import EngineConfig
from hybridpar.config import ConfigError

__all__ = ["DeepSpeedConfig", "batch_sizes", "load_ds_config", "parse_ds_config"]

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
HF_MICRO_BATCH = 8  # TrainingArguments.per_device_train_batch_size: "auto" with nothing to derive it from
SCHEDULERS = {"warmuplr": "WarmupLR", "warmupdecaylr": "WarmupDecayLR", "warmupcosinelr": "WarmupCosineLR"}
OPTIMIZER_TYPES = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}
# DeepSpeed's defaults for what the fp16 block leaves out
FP16_DEFAULTS = {"loss_scale": 0.0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                 "min_loss_scale": 1.0}


@dataclass
class DeepSpeedConfig:
    """A parsed ds_config: the engine's settings and what only the DeepSpeed engine reads."""

    engine: EngineConfig
    train_batch_size: int
    micro_batch: int  # train_micro_batch_size_per_gpu
    has_optimizer: bool  # the config names an optimizer (else the client passes one)
    scheduler: tuple[str, dict[str, Any]] | None = None  # (DeepSpeed's type name, params)
    steps_per_print: int = 10
    tensorboard_dir: Path | None = None  # output_path / job_name when enabled
    no_effect: list[str] = field(default_factory=list)  # accepted keys without a counterpart


def load_ds_config(config: Mapping[str, Any] | str | os.PathLike[str] | None,
                   config_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ds_config as a dict, from ``config`` (a dict or a JSON file's path) or ``config_params``
    (DeepSpeed's other name for it); both, neither or an unreadable file are one-line errors."""
    if config is not None and config_params is not None:
        raise ConfigError("initialize(): got both config= and config_params=; pass the ds_config once")
    given = config if config is not None else config_params
    if given is None:
        raise ConfigError("initialize(): no ds_config; pass config=<dict or path to JSON> (or config_params=)")
    if isinstance(given, str | os.PathLike):
        try:
            given = json.loads(Path(given).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"ds_config {os.fspath(given)!r} could not be read as JSON: {e}") from None
    if not isinstance(given, Mapping):
        raise ConfigError(f"ds_config must be a dict or a path to a JSON file, not {type(given).__name__}")
    return dict(given)


def _auto(value: Any, hf: Any) -> Any:
    return hf if value == "auto" else value


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"ds_config: {name} = {value!r} must be a positive integer")
    return value


def batch_sizes(cfg: Mapping[str, Any], dp: int) -> tuple[int, int, int]:
    """``(train_batch_size, micro batch per rank, gradient_accumulation_steps)`` by DeepSpeed's
    rules: any two imply the third (``train = micro * accumulation * dp``), one alone takes
    accumulation 1; ``"auto"`` is absent (nothing given: Hugging Face's micro-batch 8)."""
    tb, mb, ga = (None if cfg.get(k) in (None, "auto") else _positive_int(k, cfg[k]) for k in BATCH_KEYS)
    if tb is None and mb is None:
        if not any(cfg.get(k) == "auto" for k in BATCH_KEYS):
            raise ConfigError("ds_config: neither train_batch_size nor train_micro_batch_size_per_gpu is set; "
                              "give one of them (and gradient_accumulation_steps if not 1)")
        mb = HF_MICRO_BATCH
    if tb is not None and mb is not None and ga is not None:
        if tb != mb * ga * dp:
            raise ConfigError(f"ds_config: train_batch_size = {tb} but train_micro_batch_size_per_gpu * "
                              f"gradient_accumulation_steps * data-parallel size = {mb} * {ga} * {dp} = {mb * ga * dp}; "
                              "make them agree or give only two of the three")
        return tb, mb, ga
    if tb is None:
        ga = ga or 1
        return mb * ga * dp, mb, ga  # type: ignore[operator]
    if mb is None:
        ga = ga or 1
        if tb % (ga * dp):
            raise ConfigError(f"ds_config: train_batch_size = {tb} is not divisible by gradient_accumulation_steps "
                              f"* data-parallel size = {ga} * {dp} = {ga * dp}; make it a multiple of {ga * dp}")
        return tb, tb // (ga * dp), ga
    if tb % (mb * dp):
        raise ConfigError(f"ds_config: train_batch_size = {tb} is not divisible by train_micro_batch_size_per_gpu "
                          f"* data-parallel size = {mb} * {dp} = {mb * dp}; make it a multiple of {mb * dp}")
    return tb, mb, tb // (mb * dp)


def _optimizer(block: Mapping[str, Any]) -> dict[str, Any]:
    """The ``optimizer`` block as EngineConfig keys (``weight_decay``: every group's default)."""
    check_keys("optimizer", block)
    kind = str(block.get("type", "")).lower()
    if kind not in OPTIMIZER_TYPES:
        raise ConfigError(f"ds_config: optimizer.type = {block.get('type')!r} is not supported; supported: "
                          f"{', '.join(OPTIMIZER_TYPES.values())}")
    params = block.get("params", {})
    check_keys("optimizer.params.sgd" if kind == "sgd" else "optimizer.params.adam", params, "optimizer.params")
    out: dict[str, Any] = {"lr": float(_auto(params.get("lr", 1e-3), 5e-5))}
    if kind == "sgd":
        out.update(optimizer="sgd", momentum=float(params.get("momentum", 0.0)),
                   weight_decay=float(params.get("weight_decay", 0.0)))
        return out
    adamw = kind == "adamw" or bool(params.get("adam_w_mode", True))
    torch_default = 0.01 if adamw and params.get("torch_adam", False) else 0.0  # torch.optim.AdamW's, else DeepSpeed's kernels'
    betas = _auto(params.get("betas", (0.9, 0.999)), (0.9, 0.999))
    out.update(optimizer="adamw" if adamw else "adam", betas=(float(betas[0]), float(betas[1])),
               eps=float(_auto(params.get("eps", 1e-8), 1e-8)),
               weight_decay=float(_auto(params.get("weight_decay", torch_default), 0.0)))
    return out


def _scheduler(block: Mapping[str, Any], lr: float) -> tuple[str, dict[str, Any]]:
    check_keys("scheduler", block)
    kind = str(block.get("type", "")).lower()
    if kind not in SCHEDULERS:
        raise ConfigError(f"ds_config: scheduler.type = {block.get('type')!r} is not supported; supported: "
                          f"{', '.join(SCHEDULERS.values())}")
    params = dict(block.get("params", {}))
    check_keys(f"scheduler.params.{kind}", params, "scheduler.params")
    if params.get("total_num_steps") == "auto":
        raise ConfigError("ds_config: scheduler.params.total_num_steps = 'auto' is filled in by Hugging Face's "
                          "Trainer from the run's length; give the number of optimizer steps")
    hf = {"warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": 0}
    resolved = {k: _auto(v, hf.get(k)) for k, v in params.items()}
    check_schedule(SCHEDULERS[kind], resolved)
    return SCHEDULERS[kind], resolved


def _precision(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``fp16`` / ``bf16`` (or its alias ``bfloat16``) as ``precision`` and the loss-scale keys."""
    fp16 = cfg.get("fp16", {})
    bf16 = cfg.get("bf16", cfg.get("bfloat16", {}))
    check_keys("fp16", fp16)
    check_keys("bf16", bf16, "bf16" if "bf16" in cfg else "bfloat16")
    half = bool(_auto(fp16.get("enabled", False), False))
    brain = bool(_auto(bf16.get("enabled", False), False))
    if half and brain:
        raise ConfigError("ds_config: fp16.enabled and bf16.enabled are both true; enable one of them")
    if not half:
        return {"precision": "bf16" if brain else "fp32"}
    f = {**FP16_DEFAULTS, **{k: v for k, v in fp16.items() if k in FP16_DEFAULTS}}
    return {"precision": "fp16", "loss_scale": float(f["loss_scale"]),
            "loss_scale_init": float(2 ** int(f["initial_scale_power"])),
            "loss_scale_window": int(f["loss_scale_window"]), "loss_scale_hysteresis": int(f["hysteresis"]),
            "min_loss_scale": float(f["min_loss_scale"])}


def _offload(zero: Mapping[str, Any], stage: int) -> dict[str, Any]:
    """``offload_optimizer`` / ``offload_param`` ({device: none | cpu | nvme, nvme_path}) as
    ``offload_optimizer``/``offload_params``/``offload_to``/``offload_dir``."""
    out: dict[str, Any] = {}
    devices: dict[str, str] = {}
    for block, key in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_params")):
        spec = zero.get(block)
        if spec is None:
            continue
        check_keys(f"zero_optimization.{block}", spec)
        device = str(spec.get("device", "none")).lower()
        if device not in ("none", "cpu", "nvme"):
            raise ConfigError(f"ds_config: zero_optimization.{block}.device = {spec.get('device')!r} must be "
                              "none, cpu or nvme")
        if device == "none":
            continue
        devices[block] = device
        out[key] = True
        if device == "nvme":
            out.update(offload_to="disk", offload_dir=_nvme_path(block, spec.get("nvme_path")))
    if "offload_param" in devices and stage != 3:
        raise ConfigError(f"ds_config: zero_optimization.offload_param needs stage 3 (parameters are sharded only "
                          f"there), this config has stage {stage}; use stage 3 or drop offload_param")
    if "offload_param" in devices and devices.get("offload_optimizer") != devices["offload_param"]:
        raise ConfigError("ds_config: zero_optimization.offload_param here needs offload_optimizer on the same "
                          f"device (parameter shards live with the optimizer state); set offload_optimizer.device "
                          f"= {devices['offload_param']!r}")
    return out


def _nvme_path(block: str, path: Any) -> str:
    where = f"zero_optimization.{block}.nvme_path"
    if not path:
        raise ConfigError(f"ds_config: {block}.device = 'nvme' needs {where}; give a writable directory")
    p = Path(str(path))
    if not p.is_dir():
        raise ConfigError(f"ds_config: {where} = {str(path)!r} is not an existing directory; create it or "
                          "name another")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ConfigError(f"ds_config: {where} = {str(path)!r} is not writable; name a directory you can write")
    return str(p)


def _zero(zero: Mapping[str, Any], hidden: int | None) -> dict[str, Any]:
    check_keys("zero_optimization", zero)
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"ds_config: zero_optimization.stage = {stage!r} must be 0, 1, 2 or 3")
    hpz = zero.get("zero_hpz_partition_size", 1)
    if hpz != 1:
        raise ConfigError(f"ds_config: zero_optimization.zero_hpz_partition_size = {hpz!r} needs hybrid sharding "
                          "(ZeRO++ hpZ), which hybridpar does not have yet; remove it (shards span the whole dp axis)")
    out: dict[str, Any] = {"zero_stage": stage, **_offload(zero, stage)}
    bucket = zero.get("reduce_bucket_size")
    if bucket is not None:
        bucket = _sized("reduce_bucket_size", bucket, hidden, 1.0)
        out["bucket_mb"] = bucket * 4 / 2**20  # elements of fp32 gradients
    prefetch = zero.get("stage3_prefetch_bucket_size")
    if prefetch is not None:
        out["zero3_prefetch"] = _sized("stage3_prefetch_bucket_size", prefetch, hidden, 0.9) > 0
    return out


def _sized(key: str, value: Any, hidden: int | None, factor: float) -> float:
    """A size in elements; ``"auto"``: ``factor * hidden_size**2``, as Hugging Face's Trainer sets it."""
    if value == "auto":
        if hidden is None:
            raise ConfigError(f"ds_config: zero_optimization.{key} = 'auto' needs the model's config.hidden_size, "
                              "which this model has not; give a number of elements")
        return factor * hidden * hidden
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ConfigError(f"ds_config: zero_optimization.{key} = {value!r} must be a number of elements >= 0")
    return float(value)


def _blocks(cfg: Mapping[str, Any], hidden: int | None) -> dict[str, Any]:
    """The EngineConfig keys of every block but the batch and optimizer ones."""
    out: dict[str, Any] = {**_precision(cfg), **_zero(cfg.get("zero_optimization", {}), hidden)}
    check_keys("activation_checkpointing", cfg.get("activation_checkpointing", {}))
    check_keys("data_types", cfg.get("data_types", {}))
    checkpoint = cfg.get("checkpoint", {})
    check_keys("checkpoint", checkpoint)
    check_keys("checkpoint.parallel_write", checkpoint.get("parallel_write", {}))
    clip = _auto(cfg.get("gradient_clipping", 0.0), 1.0)
    if isinstance(clip, bool) or not isinstance(clip, int | float) or clip < 0:
        raise ConfigError(f"ds_config: gradient_clipping = {clip!r} must be a number >= 0 (0: no clipping)")
    out["grad_clip"] = float(clip)
    tp = cfg.get("tensor_parallel", {})
    check_keys("tensor_parallel", tp)
    if "autotp_size" in tp:
        out["tensor_parallel_size"] = _positive_int("tensor_parallel.autotp_size", tp["autotp_size"])
    comm = cfg.get("communication_data_type")
    names = {None: "none", "fp32": "none", "bf16": "bf16", "fp16": "fp16"}
    if comm not in names:
        raise ConfigError(f"ds_config: communication_data_type = {comm!r} must be fp32, bf16 or fp16")
    out["grad_compression"] = names[comm]
    return out


def _tensorboard(cfg: Mapping[str, Any]) -> Path | None:
    tb = cfg.get("tensorboard", {})
    check_keys("tensorboard", tb)
    if not tb.get("enabled", False):
        return None
    return Path(tb.get("output_path") or ".") / str(tb.get("job_name") or "DeepSpeedJobName")


def parse_ds_config(cfg: Mapping[str, Any], world_size: int, hidden: int | None = None,
                    client_optimizer: bool = False) -> DeepSpeedConfig:
    """Read ``cfg`` (a ds_config dict) for ``world_size`` processes: every key checked
    (:func:`~hybridpar.api.deepspeed.schema.check_keys`), mapped onto an :class:`EngineConfig`
    and validated by the engine's rules. ``hidden``: the model's ``hidden_size`` for ``"auto"``
    bucket sizes. ``client_optimizer``: ``initialize`` got ``optimizer=`` (then the config must
    not name one, as in DeepSpeed)."""
    check_keys("", cfg)
    engine = _blocks(cfg, hidden)
    tp = engine.get("tensor_parallel_size", 1)
    if world_size % tp:
        raise ConfigError(f"ds_config: tensor_parallel.autotp_size = {tp} does not divide the {world_size} "
                          "processes; launch a multiple of it")
    train, micro, ga = batch_sizes(cfg, world_size // tp)
    has_optimizer = "optimizer" in cfg
    if has_optimizer and client_optimizer:
        raise ConfigError("initialize(): optimizer= was passed and the ds_config has an optimizer block; "
                          "give only one of them")
    if has_optimizer:
        engine.update(_optimizer(cfg["optimizer"]))
    engine["gradient_accumulation_steps"] = ga
    scheduler = _scheduler(cfg["scheduler"], engine.get("lr", 1e-3)) if "scheduler" in cfg else None
    steps = cfg.get("steps_per_print", 10)
    if steps is not None:
        steps = _positive_int("steps_per_print", steps)
    out = DeepSpeedConfig(EngineConfig.from_dict(engine), train, micro, has_optimizer, scheduler,
                          steps or 0, _tensorboard(cfg), no_effect_keys(cfg))
    out.engine.validate()
    return out
