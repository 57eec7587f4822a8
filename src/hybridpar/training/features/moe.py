"""Mixture of experts (``model.n_experts > 0``), the component: the MoE layers' parallel plan
over ep (and tp) as a build step, the auxiliary losses' backward scale, expert statistics per
step and over the run, and DeepSeek-V3's auxiliary-loss-free balancing bias as an
optimizer-step hook.

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
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from hybridpar.config import Config
from hybridpar.distributed.mesh import Topology
from hybridpar.models.moe import AuxLossScale, MoE, moe_layers, update_balance_bias
from hybridpar.parallel.experts import expert_param_names, sum_over_axes
from hybridpar.training.features.base import DeviceStats, Stats, UpdateOutcome
from hybridpar.training.features.component import Component, Launch

if TYPE_CHECKING:
    from hybridpar.models.registry import Family

__all__ = ["MixtureOfExperts"]


class MixtureOfExperts(Component):
    """The MoE layers of a model trained under ``cfg`` (module doc)."""

    name = "moe"

    @classmethod
    def enabled(cls, cfg: Config, launch: Launch) -> bool:
        return bool(cfg.model.moe_layer_ids())

    def __init__(self, cfg: Config, launch: Launch) -> None:
        super().__init__(cfg, launch)
        self.layers: list[MoE] = []
        self.expert_names: set[str] = set()  # the parameters split over ep (empty at ep=1)
        self.sequence_parallel = False
        self._load: Tensor | None = None  # this step's expert load over all ranks, once collected
        # per step, each layer's max/mean expert load (fp32, on the device): blocks of rows, and
        # the latest rows (joined into a block every BLOCK steps)
        self._imbalance: list[Tensor] = []
        self._recent: list[Tensor] = []
        self._dropped: Tensor | None = None  # routed slots no expert computed, summed over steps

    def parallelize(self, model: nn.Module, topo: Topology, family: Family, sequence_parallel: bool) -> None:
        """Experts over ep (and tp), token counts over the axes that split tokens (cp, and tp
        under SP)."""
        if family.parallelize_moe is not None:
            tokens = [topo.cp, *([topo.tp] if sequence_parallel else [])]
            family.parallelize_moe(model, topo.tp, topo.ep, tokens, sequence_parallel)
        self.expert_names = expert_param_names(model) if topo.ep.size > 1 else set()
        self.layers, self.sequence_parallel, self.topo = moe_layers(model), sequence_parallel, topo

    @property
    def aux(self) -> AuxLossScale:
        """The auxiliary losses' backward scale and running value, shared by the model's layers."""
        return self.layers[0].aux_scale

    def set_grad_scale(self, scale: float) -> None:
        """The step's gradient scale (``1 / M`` times the fp16 loss scale): the auxiliary losses
        backpropagate with it (``StepEngine.on_grad_scale``)."""
        self.aux.grad_scale = scale

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
            axes = [topo.tp] if self.sequence_parallel else []
            self._load = sum_over_axes([*axes, topo.pp, topo.dp_cp], load)
        return self._load

    def after_backward(self, step: int, microbatches: int) -> Stats:
        """The step's MoE statistics over all ranks; collective (every rank, every step), kept on
        the device: returns what makes the record's dict (one read) when it is written.
        ``expert_load``: tokens routed to each expert per MoE layer (every layer, whichever stage
        holds it); ``expert_load_imbalance``: the worst layer's max/mean load; ``dropped_tokens``:
        routed slots short of tokens x k (0: the layers are dropless); ``aux_loss``: the
        auxiliary losses' sum over layers, mean over micro-batches."""
        topo = self.topo
        load = self.step_load()
        aux = torch.zeros(1, dtype=torch.float64, device=load.device) + self.aux.value  # no host copy
        self.aux.reset()
        sum_over_axes([topo.tp] if self.sequence_parallel else [], aux)  # SP: each tp rank's share
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

    def after_update(self, step: int, outcome: UpdateOutcome) -> None:
        """``model.bias_update_rate > 0``: the balancing bias update from the step's load (not
        on a skipped step)."""
        rate = self.cfg.model.bias_update_rate
        if rate > 0 and outcome.stepped:
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
