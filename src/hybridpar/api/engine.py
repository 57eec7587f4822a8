"""``hybridpar.initialize(model, config)``: data parallel / ZeRO 0-3 and a tensor-parallel plan
for any ``nn.Module``, for users who keep their own training loop.

::

    engine = hybridpar.initialize(model, {"zero_stage": 2, "lr": 1e-3, "grad_clip": 1.0,
                                          "gradient_accumulation_steps": 4})
    for x, y in loader:                     # this rank's share of the data
        loss = loss_fn(engine(x), y)        # forward (ZeRO-3 gathers parameters per unit)
        engine.backward(loss)               # scaled by 1/accumulation; no_sync but on the last
        engine.step()                       # at the boundary: clip, optimizer, zero_grad, LR
    engine.save("ckpt/step-100")            # torch.distributed.checkpoint, atomic

The engine wraps :class:`~hybridpar.parallel.zero.ZeroOptimizer` (stage 0 is plain data
parallelism with bucketed all-reduce) over the topology's dp axis, built in one call by the
data-parallel spec (:meth:`~hybridpar.parallel.zero.spec.DataParallelSpec.build`), which at
stage 3 shards the model first (one unit per child module by default), and :func:`~hybridpar.api.tp.parallelize_module`
for the plan. Gradients are averaged over dp: every dp rank should pass an equally sized share
of the global batch and a mean loss, so the result equals one process on the whole batch.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn

from hybridpar.api.autotp import autotp
from hybridpar.api.tp import (
    full_tensor_parallel_state_dict,
    parallelize_module,
    tp_sharded_params,
)
from hybridpar.config import Config, ConfigError, parse_config
from hybridpar.distributed.mesh import Topology
from hybridpar.parallel.tensor_plan import TensorPlan
from hybridpar.parallel.zero import (
    OuterSplit,
    decay_groups,
)
from hybridpar.parallel.zero.spec import DataParallelSpec, Zero3, data_parallel_spec
from hybridpar.rules import first_broken
from hybridpar.training.checkpoint import (
    CheckpointError,
    SafeReader,
    require_complete,
    single_process_quiet,
    write_checkpoint,
)
from hybridpar.training.metrics import atomic_write_text
from hybridpar.training.optim import warmup_cosine
from hybridpar.training.precision import LossScaler, autocast
from hybridpar.training.step import StepEngine

__all__ = ["EngineConfig", "ModelEngine"]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
ENGINE_INFO = "engine.json"
# the [parallel] keys this format spells as the trainer does
_PARALLEL_KEYS = ("zero_stage", "offload_optimizer", "offload_to", "offload_dir", "offload_params",
                  "grad_compression", "bucket_mb")
# the trainer's keys that this format spells otherwise (its messages are reworded with these)
_ENGINE_NAMES = {"parallel.dp": "data_parallel_size", "parallel.tp": "tensor_parallel_size",
                 "train.global_batch": "gradient_accumulation_steps", "train.beta1": "betas: beta1",
                 "train.beta2": "betas: beta2"}


@dataclass
class EngineConfig:
    """Settings of :func:`initialize` (also accepted as a plain dict with these keys): an input
    format in DeepSpeed's style for the trainer's ``[parallel]`` and ``[train]`` settings
    (:meth:`to_config`), checked by the same rules, plus the keys only a wrapped ``nn.Module``
    has (``tensor_parallel_plan``, ``zero3_units``, ``optimizer``, ``momentum``, ``decay_steps``)."""

    data_parallel_size: int | None = None  # None: world size / tensor_parallel_size
    tensor_parallel_size: int | None = None  # None: the given topology's, else 1
    # pattern -> column|row|embedding; empty with tp > 1: the model's own Hugging Face plan (AutoTP)
    tensor_parallel_plan: dict[str, Any] = field(default_factory=dict)
    zero_stage: int = 0  # 0 plain DP, 1 optimizer state, 2 + gradients, 3 + parameters sharded over dp
    zero3_units: str | list[str] = "children"  # "children", or module-name patterns (outermost match)
    offload_optimizer: bool = False  # ZeRO 1-3: optimizer state and update on the host
    offload_to: str = "cpu"  # where offloaded state lives: "cpu" (host memory) or "disk" (files)
    offload_dir: str = ""  # offload_to = "disk": the files' directory; "" = the system temporary directory
    offload_params: bool = False  # ZeRO-3 (with offload_optimizer): parameter shards offloaded too
    grad_compression: str = "none"  # gradient payload: "int8" (any stage), "bf16"/"fp16" (stages 1-3)
    bucket_mb: float = 25.0  # gradient bucket size (stages 0-2)
    optimizer: str = "adamw"  # adamw | adam | sgd
    optimizer_impl: str = "auto"  # auto (fused where supported) | fused | foreach | for-loop
    lr: float = 1e-3
    weight_decay: float = 0.0  # on parameters with >= 2 dims only
    betas: tuple[float, float] = (0.9, 0.999)  # adam/adamw
    eps: float = 1e-8  # adam/adamw
    momentum: float = 0.0  # sgd
    grad_clip: float = 0.0  # max global gradient L2 norm; 0 disables
    gradient_accumulation_steps: int = 1  # backward() calls per optimizer step
    warmup_steps: int = 0  # linear LR warm-up over this many steps
    decay_steps: int = 0  # cosine decay to min_lr over this many steps after warm-up; 0: constant
    min_lr: float = 0.0
    precision: str = "fp32"  # fp32 | bf16 | fp16: fp32 weights and optimizer, the forward under torch.autocast
    loss_scale: float = 0.0  # fp16: a static loss scale; 0 = dynamic (the next four keys)
    loss_scale_init: float = 65536.0  # fp16 dynamic loss scale: start value
    loss_scale_window: int = 200  # fp16: clean steps before the scale doubles
    loss_scale_hysteresis: int = 1  # fp16: overflows in a row before the scale halves
    min_loss_scale: float = 1.0  # fp16: the scale never halves below this
    zero3_prefetch: bool = True  # ZeRO-3: gather the next unit while this one computes

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineConfig:
        """Build from a dict; unknown keys are an error that names them and the valid keys."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"unknown engine config keys {unknown}; valid keys: {names}")
        cfg = cls(**data)
        cfg.betas = tuple(cfg.betas)  # type: ignore[assignment]
        return cfg

    def to_config(self) -> Config:
        """These settings in the trainer's spelling: the ``[parallel]`` and ``[train]`` keys they
        are (a step of ``gradient_accumulation_steps`` micro-batches of one per dp rank), read
        with the same key and type checks as a TOML file. The model section is the default's
        placeholder: the engine's model is any ``nn.Module``. Raises naming this format's keys."""
        dp = 1 if self.data_parallel_size is None else self.data_parallel_size
        parallel = {"dp": dp, "tp": 1 if self.tensor_parallel_size is None else self.tensor_parallel_size,
                    **{k: getattr(self, k) for k in _PARALLEL_KEYS}}
        if isinstance(self.offload_dir, os.PathLike):  # a Path names the directory as well as a str
            parallel["offload_dir"] = os.fspath(self.offload_dir)
        train = {"lr": self.lr, "min_lr": self.min_lr, "weight_decay": self.weight_decay, "eps": self.eps,
                 "beta1": self.betas[0], "beta2": self.betas[1], "grad_clip": self.grad_clip,
                 "warmup_steps": self.warmup_steps, "optimizer_impl": self.optimizer_impl, "micro_batch": 1,
                 "global_batch": dp * self.gradient_accumulation_steps, "precision": self.precision,
                 "loss_scale_init": self.loss_scale or self.loss_scale_init, "loss_scale_window": self.loss_scale_window}
        try:
            return parse_config({"parallel": parallel, "train": train}, "the engine config")
        except ConfigError as e:
            raise ConfigError(_engine_keys(str(e))) from None

    def data_parallel_spec(self) -> DataParallelSpec:
        """The one data-parallel spec of these settings (:func:`data_parallel_spec` of
        :meth:`to_config`, with this format's optimizer choice)."""
        return data_parallel_spec(self.to_config(), OPTIMIZERS[self.optimizer], momentum=self.momentum)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the key and the fix for an impossible value: the trainer's
        rules (:mod:`hybridpar.rules`) on :meth:`to_config`, all but those of a model's shape (the
        ``model-*`` and ``tp-*`` rules: a tensor-parallel plan splits whatever modules it names),
        then the keys only this format has."""
        broken = first_broken(self.to_config(), skip=("model-", "tp-"))
        if broken is not None:
            raise ConfigError(_engine_keys(broken.message))
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer = {self.optimizer!r} must be one of {sorted(OPTIMIZERS)}")
        if self.zero3_units != "children" and not isinstance(self.zero3_units, list):
            raise ConfigError(f"zero3_units = {self.zero3_units!r} must be 'children' or a list of patterns")
        if self.loss_scale < 0 or self.loss_scale_hysteresis < 1 or self.min_loss_scale <= 0:
            raise ConfigError(f"loss_scale = {self.loss_scale} must be >= 0 (0: dynamic), loss_scale_hysteresis = "
                              f"{self.loss_scale_hysteresis} >= 1 and min_loss_scale = {self.min_loss_scale} > 0")

    def lr_factor(self, step: int) -> float:
        """LR multiplier for optimizer step ``step`` (from 1): linear warm-up, then constant or
        cosine down to ``min_lr / lr``."""
        if self.lr == 0:
            return 1.0
        return warmup_cosine(step, 1.0, self.min_lr / self.lr, self.warmup_steps, self.decay_steps)


def _engine_keys(message: str) -> str:
    """``message`` with the trainer's ``section.key`` names in this format's spelling (the same key
    without its section, or :data:`_ENGINE_NAMES`): ``parallel.zero_stage = 4`` -> ``zero_stage = 4``."""
    return re.sub(r"\b(?:parallel|train)\.\w+", lambda m: _ENGINE_NAMES.get(m[0], m[0].partition(".")[2]), message)


def _units(model: nn.Module, spec: str | list[str]) -> list[nn.Module]:
    if spec == "children":
        return [m for m in model.children() if any(True for _ in m.parameters())]
    units: list[nn.Module] = []
    chosen: list[str] = []
    for name, m in model.named_modules():  # outermost match wins: units must not nest
        if name and not any(name.startswith(c + ".") for c in chosen) and \
                any(fnmatch.fnmatchcase(name, p) for p in spec):
            units.append(m)
            chosen.append(name)
    if not units:
        raise ValueError(f"zero3_units {spec} match no module of the model")
    return units


def _by_name(model: nn.Module, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``groups`` with each ``(name, parameter)`` resolved by name on ``model`` now: a tensor-parallel
    plan or ZeRO-3's sharding replaced the parameters the groups were made of."""
    current = dict(model.named_parameters())
    return [{**g, "params": [(n, current[n]) for n, _ in g["params"]]} for g in groups]


class ModelEngine:
    """One model, its (ZeRO) optimizer and gradient reduction under a dp x tp topology; see the
    module doc. Build it with :func:`initialize`."""

    def __init__(self, model: nn.Module, cfg: EngineConfig, topo: Topology, owns_topology: bool = False,
                 param_groups: list[dict[str, Any]] | None = None) -> None:
        """``param_groups``: named torch-style groups (``[{"params": [(name, p), ...], "weight_decay": ...}]``)
        instead of :func:`decay_groups` (``weight_decay`` on matrices only)."""
        cfg.validate()
        if topo.pp.size > 1 or topo.cp.size > 1:
            raise ValueError(f"initialize() handles dp x tp layouts; this topology has pp = {topo.pp.size}, "
                             f"cp = {topo.cp.size}: use hybridpar.PipelineModule for pipeline parallelism")
        if cfg.tensor_parallel_size not in (None, topo.tp.size):
            raise ValueError(f"tensor_parallel_size = {cfg.tensor_parallel_size} but the topology has tp = {topo.tp.size}")
        self.cfg, self.topo, self._owns_topology = cfg, topo, owns_topology
        model = model.to(topo.device)
        partial: frozenset[str] = frozenset()  # replicated parameters with per-rank partial gradients
        if cfg.tensor_parallel_plan:
            parallelize_module(model, topo.tp, cfg.tensor_parallel_plan)
        elif topo.tp.size > 1:  # AutoTP: the model's own (Hugging Face) plan, else refused naming the key
            partial = autotp(model, topo.tp).partial
        self.module = model
        self.tp_sharded = tp_sharded_params(model)
        plan = TensorPlan.of_names({name: dim for name, (dim, _) in self.tp_sharded.items()})
        # checkpoints hold DTensor pieces of the whole tensors (tp's split, then ZeRO's): any tp reads them
        outer = OuterSplit(topo.tp, plan.shard_dim) if topo.tp.size > 1 else None
        zero3 = Zero3(model, _units(model, cfg.zero3_units) if cfg.zero_stage == 3 else (), prefetch=cfg.zero3_prefetch)
        groups = decay_groups(model, cfg.weight_decay) if param_groups is None else _by_name(model, param_groups)
        self.optimizer = cfg.data_parallel_spec().build(groups, topo.dp, zero3=zero3, outer=outer)  # ZeRO-3: sharded here
        self.core = StepEngine(topo, self.optimizer, plan, list(model.named_parameters()), tp_partial=partial)
        self._base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.global_step = 0  # optimizer steps taken
        self.micro_step = 0  # backward() calls since the last optimizer step
        self._finished = False  # this step's gradients reduced (grad_norm() before step())
        self._last_grad_norm: Tensor | float | None = None  # on the device until read
        static = cfg.loss_scale > 0  # fp16 with a static scale: overflowing steps are skipped, the scale stays
        self.scaler = LossScaler(cfg.precision == "fp16", cfg.loss_scale or cfg.loss_scale_init, cfg.loss_scale_window,
                                 growth=1.0 if static else 2.0, backoff=1.0 if static else 0.5,
                                 min_scale=cfg.min_loss_scale, hysteresis=cfg.loss_scale_hysteresis)
        self.skipped_steps = 0  # fp16: optimizer steps skipped on an overflow
        self.optimizer.zero_grad()
        self._set_lr(1)

    # ------------------------------------------------------------------ the loop
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward: tensors are moved to this rank's device, then ``module(*args, **kwargs)``."""
        def move(x: Any) -> Any:
            return x.to(self.topo.device) if isinstance(x, Tensor) else x
        with autocast(self.cfg.precision, self.topo.device):
            return self.module(*(move(a) for a in args), **{k: move(v) for k, v in kwargs.items()})

    def backward(self, loss: Tensor) -> None:
        """Backward of one micro-batch's loss, scaled by ``1 / gradient_accumulation_steps``.
        Every micro-batch but the last of a step accumulates locally (no communication)."""
        ga = self.cfg.gradient_accumulation_steps
        if self.micro_step >= ga:
            raise RuntimeError(f"{self.micro_step} backward() calls since the last step() with "
                               f"gradient_accumulation_steps = {ga}: call engine.step()")
        self.core.backward(lambda: loss / ga, self.scaler.scale, last=self.micro_step == ga - 1)
        self.micro_step += 1

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next :meth:`step` will update the weights."""
        return self.micro_step == self.cfg.gradient_accumulation_steps

    def step(self) -> bool:
        """At the accumulation boundary: finish the gradient reduction, clip by the global norm,
        step the optimizer, zero the gradients and move the LR schedule; returns True. Before
        the boundary it does nothing and returns False (call it after every backward)."""
        if not self.is_gradient_accumulation_boundary():
            return False
        self._finish()
        overflow = self.scaler.unscale(self.core.gradients(), self.topo.world)  # fp16 only: the flag, on the device
        if overflow is not None and not self.scaler.decide(bool(overflow.item() > 0), self.core.gradients()):
            self.skipped_steps += 1  # every rank saw the overflow: all skip, the scale shrank
            self._last_grad_norm = None
        else:
            self._last_grad_norm = self.core.update(self.cfg.grad_clip).detach()  # on the device: no read
        self._finished = False
        self.optimizer.zero_grad()
        self.global_step += 1
        self.micro_step = 0
        self._set_lr(self.global_step + 1)
        return True

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm before clipping of the last optimizer step (None before the
        first): kept on the device by :meth:`step` and read to the host here, on first access."""
        if isinstance(self._last_grad_norm, Tensor):
            self._last_grad_norm = float(self._last_grad_norm)
        return self._last_grad_norm

    def grad_norm(self) -> Tensor:
        """Global L2 norm of the accumulated, dp-averaged gradient (collective)."""
        self._finish()
        return self.core.grad_norm()

    def _finish(self) -> None:
        """The step's gradient reduction (and the sum of tp-partial gradients), once per step."""
        if not self._finished:
            self.core.finish()
            self._finished = True

    def _set_lr(self, step: int) -> None:
        factor = self.cfg.lr_factor(step)
        for g, base in zip(self.optimizer.param_groups, self._base_lrs, strict=True):
            g["lr"] = base * factor

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step uses (first parameter group)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def train(self, mode: bool = True) -> ModelEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ModelEngine:
        self.module.eval()
        return self

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, Tensor]:
        """The model's weights as one process would hold them, on every rank (collective:
        ZeRO-3 and tensor-parallel shards are gathered)."""
        sd = self.optimizer.gather_full_state_dict()  # ZeRO-3's shards gathered; None: whole already
        keep = self.module.state_dict()  # its keys: not the non-persistent buffers (as the trainer's)
        sd = keep if sd is None else {k: v for k, v in sd.items() if k in keep}
        return full_tensor_parallel_state_dict(sd, self.tp_sharded, self.topo.tp)

    def _state(self) -> dict[str, Any]:
        return self.optimizer.checkpoint_state(self.module)

    def save(self, path: str | os.PathLike[str], client_state: Mapping[str, Any] | None = None,
             files: Callable[[Path], None] | None = None) -> Path:
        """Write model + optimizer (each rank its shards, through ``torch.distributed.checkpoint``)
        and ``client_state`` (JSON-serialisable) to directory ``path``, atomically and durably,
        with the trainer's writer (:func:`hybridpar.training.checkpoint.write_checkpoint`: a full
        disk is one clear error and leaves no partial directory). ``files(tmp)``: more small files
        rank 0 writes into the checkpoint before it is published. Collective: every rank calls it."""
        topo = self.topo
        info = {"global_step": self.global_step, "dp": topo.dp.size, "tp": topo.tp.size,
                "zero_stage": self.cfg.zero_stage, "client_state": dict(client_state or {}),
                "loss_scaler": {**self.scaler.state_dict(), "tolerance": self.scaler.tolerance},
                "skipped_steps": self.skipped_steps}

        def write(tmp: Path) -> None:
            atomic_write_text(tmp / ENGINE_INFO, json.dumps(info, indent=2) + "\n")
            if files is not None:
                files(tmp)

        return write_checkpoint(Path(path), self._state(), topo, self.global_step, write)

    def load(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore a checkpoint written by :meth:`save` (any dp size, ZeRO stage and tensor-parallel
        size: each rank reads its pieces of the whole tensors) and return its ``client_state``. Collective."""
        path = require_complete(Path(path))
        try:
            info = json.loads((path / ENGINE_INFO).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"checkpoint {path}: unreadable {ENGINE_INFO} ({e})") from None
        state = self._state()
        try:
            with single_process_quiet():
                dcp.load(state, storage_reader=SafeReader(str(path)), process_group=self.topo.world.group,
                         no_dist=self.topo.world_size == 1)
        except Exception as e:
            raise CheckpointError(f"checkpoint {path} could not be loaded: {str(e).splitlines()[0][:300]}") from e
        self.optimizer.load_checkpoint_state(self.module, state)
        self.global_step, self.micro_step = int(info["global_step"]), 0
        if self.scaler.enabled and "loss_scaler" in info:
            self.scaler.load_state_dict(info["loss_scaler"])
            self.scaler.tolerance = int(info["loss_scaler"]["tolerance"])
        self.skipped_steps = int(info.get("skipped_steps", 0))
        self._set_lr(self.global_step + 1)
        self.optimizer.zero_grad()
        return dict(info.get("client_state", {}))

    def close(self) -> None:
        """Release the process groups of a topology this engine created itself."""
        if self._owns_topology:
            self.topo.close()
