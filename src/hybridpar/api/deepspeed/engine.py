"""The engine a DeepSpeed training loop talks to: :class:`DeepSpeedEngine`, a
:class:`~hybridpar.api.engine.ModelEngine` (the same one ``initialize(model, config)`` returns)
with DeepSpeed's method names and step semantics on top.

What DeepSpeed's engine does and this one does the same way: ``step()`` is called after every
``backward``; the optimizer steps at the accumulation boundary (``is_gradient_accumulation_boundary``
counts ``step()`` calls); ``backward`` divides by ``gradient_accumulation_steps``; an fp16 overflow
skips the step (``global_steps`` still counts it, the LR schedule does not); ``get_lr()`` is a list
per parameter group; ``save_checkpoint``/``load_checkpoint`` write and read ``<dir>/<tag>`` and a
``latest`` file (:mod:`hybridpar.api.deepspeed.checkpoint`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from hybridpar.api.deepspeed.checkpoint import load, save
from hybridpar.api.deepspeed.config import DeepSpeedConfig
from hybridpar.api.deepspeed.schedules import schedule_lrs
from hybridpar.api.engine import ModelEngine
from hybridpar.distributed.mesh import Topology

__all__ = ["DeepSpeedEngine"]


class DeepSpeedEngine(ModelEngine):
    """DeepSpeed's engine interface over :class:`ModelEngine` (module doc). ``client_scheduler``:
    the ``lr_scheduler=`` callable of ``initialize`` (called with the optimizer's torch optimizer),
    stepped after every applied optimizer step instead of the ds_config's ``scheduler``."""

    def __init__(self, model: nn.Module, ds: DeepSpeedConfig, topo: Topology, owns_topology: bool,
                 param_groups: list[dict[str, Any]] | None,
                 client_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None) -> None:
        self.ds = ds
        self.lr_scheduler: Any = None  # set after the optimizer exists; _set_lr reads it
        super().__init__(model, ds.engine, topo, owns_topology, param_groups)
        self.micro_steps = 0  # step() calls, DeepSpeed's count (the boundary is every gradient_accumulation_steps)
        self._step_losses: list[Tensor] = []  # this step's micro-batch losses, for tensorboard
        if client_scheduler is not None:
            self.lr_scheduler = client_scheduler(self.optimizer.inner)
        self._set_lr(1)
        self._board = None
        if ds.tensorboard_dir is not None and topo.rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self._board = SummaryWriter(log_dir=os.fspath(ds.tensorboard_dir))

    # ------------------------------------------------------------------ DeepSpeed's loop
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``engine.forward(...)``: the same as ``engine(...)``."""
        return self(*args, **kwargs)

    def backward(self, loss: Any, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Any:  # type: ignore[override]
        """Backward of one micro-batch's loss (divided by ``gradient_accumulation_steps``, as
        DeepSpeed's ``scale_wrt_gas``). A model output with a ``.loss`` (Hugging Face's) stands
        for its loss. Returns the loss."""
        if not isinstance(loss, Tensor) and isinstance(getattr(loss, "loss", None), Tensor):
            loss = loss.loss
        if not isinstance(loss, Tensor):
            raise TypeError(f"engine.backward() takes the loss tensor, got {type(loss).__name__}")
        if retain_graph or not scale_wrt_gas:
            raise ValueError("engine.backward(): retain_graph=True and scale_wrt_gas=False are not supported")
        super().backward(loss)
        if self._board is not None:
            self._step_losses.append(loss.detach().float())
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` updates the weights: DeepSpeed's count of ``step()`` calls."""
        return (self.micro_steps + 1) % self.cfg.gradient_accumulation_steps == 0

    def step(self, lr_kwargs: Mapping[str, Any] | None = None) -> None:  # type: ignore[override]
        """Call after every ``backward``: at the accumulation boundary clip, step the optimizer
        (or skip on an fp16 overflow), zero the gradients and move the LR schedule."""
        if lr_kwargs:
            raise ValueError("engine.step(lr_kwargs=...) is not supported; the schedule comes from the ds_config")
        boundary = self.is_gradient_accumulation_boundary()
        skipped = self.skipped_steps
        if boundary:
            super().step()
            if self.lr_scheduler is not None and self.skipped_steps == skipped:
                self.lr_scheduler.step()
            self._report()
        self.micro_steps += 1

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step updated the weights (False after an fp16 overflow)."""
        return self._last_grad_norm is not None

    def zero_grad(self) -> None:
        """Drop the accumulated gradients (``step`` already does at the boundary)."""
        self.optimizer.zero_grad()

    # ------------------------------------------------------------------ learning rate
    def _set_lr(self, step: int) -> None:
        """The ds_config's schedule (DeepSpeed's iteration: applied optimizer steps - 1), a client
        scheduler's own, or without either the constant optimizer LR."""
        ds = getattr(self, "ds", None)
        if ds is None or ds.scheduler is None or self.lr_scheduler is not None:
            return
        kind, params = ds.scheduler
        it = self.global_step - self.skipped_steps - 1
        for g, lr in zip(self.optimizer.param_groups, schedule_lrs(kind, params, self._base_lrs, it), strict=True):
            g["lr"] = lr

    def get_lr(self) -> list[float]:
        """The LR of every parameter group (what the next optimizer step uses)."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    # ------------------------------------------------------------------ what a loop reads
    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (skipped fp16 steps included, as DeepSpeed counts)."""
        return self.global_step

    @property
    def global_samples(self) -> int:
        return self.global_step * self.ds.train_batch_size

    def train_batch_size(self) -> int:
        return self.ds.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.ds.micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self.cfg.gradient_accumulation_steps

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm before clipping of the last applied step (None before one)."""
        return self.last_grad_norm

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def global_rank(self) -> int:
        return self.topo.rank

    @property
    def world_size(self) -> int:
        return self.topo.world_size

    @property
    def dp_world_size(self) -> int:
        return self.topo.dp.size

    @property
    def device(self) -> torch.device:
        return self.topo.device

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (torchrun's ``LOCAL_RANK``), as DeepSpeed's."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def mp_world_size(self) -> int:
        """DeepSpeed's model-parallel size: the tensor-parallel size (AutoTP)."""
        return self.topo.tp.size

    def fp16_enabled(self) -> bool:
        return self.cfg.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.cfg.precision == "bf16"

    def zero_optimization_stage(self) -> int:
        return self.cfg.zero_stage

    def _report(self) -> None:
        """steps_per_print's line and the tensorboard scalars, on rank 0, as DeepSpeed writes them."""
        every = self.ds.steps_per_print
        if every and self.global_step % every == 0 and self.topo.rank == 0:
            print(f"[hybridpar] step={self.global_step}, skipped={self.skipped_steps}, lr={self.get_lr()}",
                  flush=True)
        if self._board is not None:
            samples = self.global_samples
            if self._step_losses:
                self._board.add_scalar("Train/Samples/train_loss", float(torch.stack(self._step_losses).mean()), samples)
            self._board.add_scalar("Train/Samples/lr", self.get_lr()[0], samples)
            if self.scaler.enabled:
                self._board.add_scalar("Train/Samples/loss_scale", self.scaler.scale, samples)
            self._board.flush()
        self._step_losses = []

    def close(self) -> None:
        if self._board is not None:
            self._board.close()
        super().close()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: Any = None,
                        client_state: Mapping[str, Any] | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Write ``<save_dir>/<tag>`` (default ``global_step<N>``) in hybridpar's reshardable
        format and ``<save_dir>/latest`` naming it; ``client_state`` comes back from
        :meth:`load_checkpoint`. Collective. Returns True, as DeepSpeed's."""
        if exclude_frozen_parameters:
            raise ValueError("save_checkpoint(exclude_frozen_parameters=True) is not supported")
        save(self, save_dir, tag, client_state, save_latest)
        return True

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str, dict[str, Any]]:
        """Restore ``<load_dir>/<tag>`` (default: the tag in ``latest``), written at any dp size,
        ZeRO stage and world size; returns ``(path, client_state)``. Collective."""
        if not (load_module_strict and load_optimizer_states and load_lr_scheduler_states) or load_module_only \
                or custom_load_fn is not None:
            raise ValueError("load_checkpoint() restores the whole engine: load_module_strict, load_optimizer_states "
                             "and load_lr_scheduler_states must stay True, load_module_only False, custom_load_fn None")
        return load(self, load_dir, tag)

    def save_16bit_model(self, save_dir: str | os.PathLike[str], save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's ``save_16bit_model``: the whole model's weights (ZeRO-3 and tensor-parallel
        shards gathered) in one ``torch.save`` file ``<save_dir>/<save_filename>``, written by rank 0,
        in the training's 16-bit type (bf16 or fp16; fp32 stays fp32, as DeepSpeed saves the
        module's own type). Collective. Returns True."""
        if exclude_frozen_parameters:
            raise ValueError("save_16bit_model(exclude_frozen_parameters=True) is not supported")
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.cfg.precision)
        sd = self.full_state_dict()
        if self.topo.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            out = {k: v.detach().to("cpu", dtype if dtype is not None and v.is_floating_point() else v.dtype)
                   for k, v in sd.items()}
            torch.save(out, os.path.join(save_dir, save_filename))
        return True
