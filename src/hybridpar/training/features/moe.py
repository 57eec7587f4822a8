"""Mixture of experts in the step: expert statistics per step and over the run, and
DeepSeek-V3's auxiliary-loss-free balancing bias as an optimizer-step hook.

Every step (after the backward, collective) the routers' token counts are summed over all
ranks into the step's expert load ``[MoE layers, experts]``; ``metrics.jsonl`` records
``aux_loss expert_load_imbalance expert_imbalance_per_layer dropped_tokens expert_load`` and
``summary.json`` the run's ``expert_imbalance expert_imbalance_per_layer dropped_tokens``. With
``model.bias_update_rate > 0`` each update is followed by the bias update from that load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hybridpar.config import Config
from hybridpar.models.moe import MoE, update_balance_bias
from hybridpar.parallel.experts import sum_over_axes
from hybridpar.training.engine import Engine
from hybridpar.training.features.base import StepFeature

__all__ = ["ExpertBalance"]


class ExpertBalance(StepFeature):
    """The MoE layers ``engine.moe`` of a model trained under ``cfg`` (module doc)."""

    def __init__(self, cfg: Config, engine: Engine) -> None:
        self.cfg, self.engine, self.topo = cfg, engine, engine.topo
        self.layers: list[MoE] = engine.moe
        self._load: Tensor | None = None  # this step's expert load over all ranks, once collected
        self.imbalance: list[list[float]] = []  # per step, each layer's max/mean expert load
        self.dropped_tokens = 0  # routed slots no expert computed (0: the layers are dropless)

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

    def after_backward(self, step: int, microbatches: int) -> dict[str, Any]:
        """The step's MoE statistics over all ranks; collective (every rank, every step).
        ``expert_load``: tokens routed to each expert per MoE layer (every layer, whichever stage
        holds it); ``expert_load_imbalance``: the worst layer's max/mean load; ``dropped_tokens``:
        routed slots short of tokens x k (0: the layers are dropless); ``aux_loss``: the
        auxiliary losses' sum over layers, mean over micro-batches."""
        topo, model = self.topo, self.engine.model
        load = self.step_load()
        aux = torch.tensor([model.moe_aux.value], dtype=torch.float64)
        model.moe_aux.reset()
        sum_over_axes([topo.tp] if self.engine.sequence_parallel else [], aux)  # SP: each tp rank's share
        topo.comm.all_reduce(aux, topo.pp)
        topo.comm.all_reduce(aux, topo.dp_cp, op="avg")
        t, m = self.cfg.train, self.cfg.model
        slots = t.global_batch * t.seq_len * m.experts_per_token
        per_layer = (load.max(1).values / load.mean(1)).tolist()
        stats = {"aux_loss": float(aux) / microbatches, "expert_load_imbalance": max(per_layer),
                 "expert_imbalance_per_layer": per_layer,
                 "dropped_tokens": int(slots * len(self.layers) - load.sum().item()),
                 "expert_load": load.long().tolist()}
        self.imbalance.append(stats["expert_imbalance_per_layer"])
        self.dropped_tokens += stats["dropped_tokens"]
        return stats

    def after_update(self, step: int) -> None:
        """``model.bias_update_rate > 0``: the balancing bias update from the step's load."""
        rate = self.cfg.model.bias_update_rate
        if rate > 0:
            update_balance_bias(self.layers, self.step_load(), rate)

    def summary(self) -> dict[str, Any]:
        """Max/mean tokens per expert over the run's steps: the worst layer's, each layer's."""
        if not self.imbalance:
            return {}
        per_layer = torch.tensor(self.imbalance).mean(0).tolist()
        return {"expert_imbalance": max(per_layer), "expert_imbalance_per_layer": per_layer,
                "dropped_tokens": self.dropped_tokens}
