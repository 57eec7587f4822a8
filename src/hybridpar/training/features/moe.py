"""Mixture of experts in the step: expert statistics per step and over the run, and
DeepSeek-V3's auxiliary-loss-free balancing bias as an optimizer-step hook.

Every step (after the backward, collective) the routers' token counts are summed over all
ranks into the step's expert load ``[MoE layers, experts]``; ``metrics.jsonl`` records
``aux_loss expert_load_imbalance expert_imbalance_per_layer dropped_tokens expert_load`` and
``summary.json`` the run's ``expert_imbalance expert_imbalance_per_layer dropped_tokens``. With
``model.bias_update_rate > 0`` each update is followed by the bias update from that load.

Nothing is read to the host during a step: a step's statistics stay on the device until its
record is written (one read, at log steps), and the run's totals accumulate on the device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hybridpar.config import Config
from hybridpar.models.moe import MoE, update_balance_bias
from hybridpar.parallel.experts import sum_over_axes
from hybridpar.training.engine import Engine
from hybridpar.training.features.base import DeviceStats, Stats, StepFeature

__all__ = ["ExpertBalance"]


class ExpertBalance(StepFeature):
    """The MoE layers ``engine.moe`` of a model trained under ``cfg`` (module doc)."""

    def __init__(self, cfg: Config, engine: Engine) -> None:
        self.cfg, self.engine, self.topo = cfg, engine, engine.topo
        self.layers: list[MoE] = engine.moe
        self._load: Tensor | None = None  # this step's expert load over all ranks, once collected
        # per step, each layer's max/mean expert load (fp32, on the device): blocks of rows, and
        # the latest rows (joined into a block every BLOCK steps)
        self._imbalance: list[Tensor] = []
        self._recent: list[Tensor] = []
        self._dropped: Tensor | None = None  # routed slots no expert computed, summed over steps

    def start_step(self, step: int, batches: Sequence[tuple]) -> None:
        self._load = None

    def step_load(self) -> Tensor:
        """``[MoE layers, experts]``: tokens routed to each expert this step over all ranks (each
        tp rank routed its sequence chunk under SP; a layer runs on one pp stage); collective,
        once per step, and the routers' counters restart."""
        if self._load is None:
            topo = self.topo
            load = torch.stack([moe.router.load for moe in self.layers])  # other stages' layers: zeros
            for moe in self.layers:
                moe.router.load.zero_()
            axes = [topo.tp] if self.engine.sequence_parallel else []
            self._load = sum_over_axes([*axes, topo.pp, topo.dp_cp], load)
        return self._load

    def after_backward(self, step: int, microbatches: int) -> Stats:
        """The step's MoE statistics over all ranks; collective (every rank, every step), kept on
        the device: returns what makes the record's dict (one read) when it is written.
        ``expert_load``: tokens routed to each expert per MoE layer (every layer, whichever stage
        holds it); ``expert_load_imbalance``: the worst layer's max/mean load; ``dropped_tokens``:
        routed slots short of tokens x k (0: the layers are dropless); ``aux_loss``: the
        auxiliary losses' sum over layers, mean over micro-batches."""
        topo, model = self.topo, self.engine.model
        load = self.step_load()
        aux = torch.zeros(1, dtype=torch.float64, device=load.device) + model.moe_aux.value  # no host copy
        model.moe_aux.reset()
        sum_over_axes([topo.tp] if self.engine.sequence_parallel else [], aux)  # SP: each tp rank's share
        topo.comm.all_reduce(aux, topo.pp)
        topo.comm.all_reduce(aux, topo.dp_cp, op="avg")
        t, m = self.cfg.train, self.cfg.model
        slots = t.global_batch * t.seq_len * m.experts_per_token
        per_layer = load.max(1).values / load.mean(1)
        dropped = (slots * len(self.layers) - load.sum()).reshape(1)
        self._recent.append(per_layer.float())  # the summary's fp32 mean over steps
        if len(self._recent) == BLOCK:
            self._imbalance.append(torch.stack(self._recent))
            self._recent = []
        self._dropped = dropped if self._dropped is None else self._dropped + dropped
        return DeviceStats((per_layer, aux / microbatches, dropped, load), functools.partial(_step_stats, load.shape))

    def after_update(self, step: int) -> None:
        """``model.bias_update_rate > 0``: the balancing bias update from the step's load."""
        rate = self.cfg.model.bias_update_rate
        if rate > 0:
            update_balance_bias(self.layers, self.step_load(), rate)

    def summary(self) -> dict[str, Any]:
        """Max/mean tokens per expert over the run's steps: the worst layer's, each layer's."""
        rows = [*self._imbalance, *([torch.stack(self._recent)] if self._recent else [])]
        if not rows or self._dropped is None:
            return {}
        per_layer = torch.cat(rows).mean(0).tolist()
        return {"expert_imbalance": max(per_layer), "expert_imbalance_per_layer": per_layer,
                "dropped_tokens": int(self._dropped.item())}


BLOCK = 256  # steps of per-layer imbalance kept as separate rows before they are joined


def _step_stats(shape: torch.Size, values: list[list[float]]) -> dict[str, Any]:
    """One step's ``metrics.jsonl`` statistics from the values read of its device tensors."""
    per, (aux,), (dropped,), flat = values
    e = shape[1]
    return {"aux_loss": aux, "expert_load_imbalance": max(per), "expert_imbalance_per_layer": per,
            "dropped_tokens": int(dropped),
            "expert_load": [[int(v) for v in flat[i * e:(i + 1) * e]] for i in range(shape[0])]}
