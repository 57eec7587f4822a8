"""Mixture-of-experts terms of the planner: the parameters of an MoE layer, how routed rows
spread over the expert-parallel ranks, and the routing imbalance.

**Parameters.** An MoE layer's feed-forward (:class:`hybridpar.models.moe.MoE`) registers the
router ``[E, D]`` (replicated over tp and ep), the stacked routed experts ``w1``/``w3``
``[E/ep, H/tp, D]`` and ``w2`` ``[E/ep, D, H/tp]`` (each tp rank holds ``H/tp`` of each of its
``E/ep`` experts, as :class:`hybridpar.parallel.experts.ExpertParallel` cuts them), then the
optional shared experts (a dense SwiGLU MLP of ``n_shared_experts * H``, tp-split like the dense
MLP). With ep > 1 the experts are a ZeRO group of their own over the ``edp = dp * cp / ep`` ranks
that hold the same experts; with ep = 1 they are ordinary data-parallel parameters.

**Routing.** Per MoE layer and micro-batch a rank dispatches the ``k T`` routed slots of the
``T`` tokens of its tensor-parallel group (``T = micro_batch * seq / cp``; under sequence
parallelism the tokens are all-gathered over tp first). Let ``load`` be how many slots the rank's
experts receive relative to the mean (``1`` balanced). When every rank routes its tokens with the
same distribution over experts (true on average; exact for the forced routings the tests use),
the rank receives ``load * k T`` rows (its own share included), sends ``k T (1 - load / ep)`` rows
to other ranks and receives ``load * k T (ep - 1) / ep`` from them. Its wire bytes per layer and
micro-batch (:func:`all_to_all_wire_bytes`): forward dispatch + combine, backward the same
reversed, each ``(sent + received from others) * D * bytes``, so ``2 (k T) (1 + load (ep - 2) /
ep) D a`` for each pass; balanced, ``4 (ep - 1)/ep k T D a`` per layer and micro-batch (and at
ep = 2 the same whatever the load: what one rank does not send, it receives).

**Imbalance.** Real routing is not balanced: the slowest ep rank (the one holding the hottest
experts) bounds every MoE layer, computes ``load * k T`` rows and receives the most. The planner
takes the imbalance as the max/mean tokens per expert (what a run logs as
``expert_load_imbalance`` in ``metrics.jsonl`` and ``expert_imbalance`` in ``summary.json``) and
prices the worst rank at ``load = 1 + (imbalance - 1) ep / E`` (:func:`rank_load`): the hottest
expert's rank, its other ``E/ep - 1`` experts at the mean. That is exact at ep = E (one expert
per rank); for ep < E it lies between the bounds ``1`` and ``min(imbalance, ep)`` (a rank's mean
over its experts never exceeds their max): one hot expert per layer, the common case under a
balancing loss. With ep = 1 one rank computes every slot and the imbalance costs nothing.
The default, :data:`DEFAULT_IMBALANCE` = 1.25, is the capacity factor Switch Transformer trains with (Fedus et al. 2021, section 2.2: the slack per expert that
drops few tokens under a load-balancing loss); ``hybridpar plan --moe-imbalance X`` overrides it
and ``--from-run DIR`` reads a run's measured value (:func:`imbalance_from_run`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from hybridpar.config import ModelConfig
from hybridpar.planner.machine.hardware import PlanError

DEFAULT_IMBALANCE = 1.25

Shape = tuple[int, ...]


def ffn_shapes(model: ModelConfig, layer: int, tp: int, ep: int = 1) -> list[tuple[str, Shape]]:
    """Layer ``layer``'s feed-forward parameters (names after ``layers.<i>.feed_forward.``) in
    registration order, tp- and ep-local shapes: the dense SwiGLU MLP, or for an MoE layer the
    router, the routed experts and the shared experts (module doc)."""
    d = model.dim
    if layer not in model.moe_layer_ids():
        f = model.ffn_hidden // tp
        return [("w1.weight", (f, d)), ("w3.weight", (f, d)), ("w2.weight", (d, f))]
    e, h = model.n_experts // ep, model.expert_hidden // tp
    out: list[tuple[str, Shape]] = [("router.weight", (model.n_experts, d)),
                                    ("experts.w1", (e, h, d)), ("experts.w3", (e, h, d)), ("experts.w2", (e, d, h))]
    if model.n_shared_experts:
        s = model.n_shared_experts * model.expert_hidden // tp
        out += [("shared_experts.w1.weight", (s, d)), ("shared_experts.w3.weight", (s, d)),
                ("shared_experts.w2.weight", (d, s))]
    return out


def is_expert(name: str) -> bool:
    """Whether parameter ``name`` is a routed expert (sharded over ep, reduced over edp)."""
    return ".feed_forward.experts." in name or name.startswith("feed_forward.experts.")


def replicated_ffn(name: str) -> bool:
    """Whether feed-forward parameter ``name`` is replicated over tp (the router): under
    sequence parallelism its gradient is a partial sum over tp, like the norms'."""
    return name.endswith("router.weight")


def rank_load(imbalance: float, ep: int, n_experts: int) -> float:
    """Slots the busiest ep rank's experts receive relative to the mean, when the hottest of
    ``n_experts`` experts gets ``imbalance`` times the mean and the rank's other ``E/ep - 1``
    experts the mean: ``1 + (imbalance - 1) ep / E``, at most ``ep`` (module doc)."""
    if ep <= 1:
        return 1.0
    return min(1.0 + (max(1.0, imbalance) - 1.0) * ep / n_experts, float(ep))


def dispatch_rows(tokens: int, k: int, ep: int, load: float) -> tuple[float, float, float]:
    """``(sent to other ranks, received from other ranks, computed here)`` routed rows of one
    rank whose experts receive ``load`` times the mean, per MoE layer and micro-batch of
    ``tokens`` tokens in its tp group (module doc; at ep = 1 nothing moves)."""
    slots = k * tokens
    if ep <= 1:
        return 0.0, 0.0, float(slots)
    return slots * (1 - load / ep), slots * load * (ep - 1) / ep, slots * load


def all_to_all_wire_bytes(tokens: int, k: int, ep: int, load: float, row_bytes: float) -> float:
    """Wire bytes (:meth:`hybridpar.distributed.comm.Comm.all_to_all`: rows sent to other ranks
    times their bytes) of one MoE layer and micro-batch, forward and backward, dispatch and
    combine, without the small counts exchange (:func:`count_exchange_wire_bytes`)."""
    sent, received, _ = dispatch_rows(tokens, k, ep, load)
    return 2 * (sent + received) * row_bytes


def count_exchange_wire_bytes(model: ModelConfig, ep: int) -> int:
    """Wire bytes of the per-expert counts all-to-all (int64 ``[ep, E/ep]``; forward only)."""
    return 0 if ep <= 1 else (ep - 1) * (model.n_experts // ep) * 8


# ----------------------------------------------------------------------------- a run's imbalance


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _number(value: object) -> float | None:
    """A logged imbalance as one number: a number, the mean of a per-layer list, or a dict's
    ``mean`` (else ``max``) entry."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        return _mean([x for x in map(_number, value) if x is not None])
    if isinstance(value, dict):
        for key in ("mean", "max"):
            if key in value:
                return _number(value[key])
    return None


def imbalance_from_run(run_dir: str | Path) -> tuple[float, str]:
    """``(imbalance, where it came from)`` of a training run, as the trainer logs it:
    ``summary.json``'s ``expert_imbalance_per_layer`` (max/mean tokens per expert of each MoE
    layer, averaged over the run's steps), else its ``expert_imbalance`` (the worst layer's),
    else ``metrics.jsonl``'s per-step ``expert_imbalance_per_layer`` (or ``expert_load_imbalance``,
    the worst layer's) averaged over the logged steps. A per-layer list counts as its mean over
    layers: each layer's imbalance slows that layer, and the planner prices every MoE layer with
    one factor. Raises :class:`PlanError` when the run logged none of them."""
    root = Path(run_dir)
    if not root.is_dir():
        raise PlanError(f"--from-run {str(run_dir)!r} is not a directory; give a run's train.run_dir")
    summary = root / "summary.json"
    if summary.is_file():
        try:
            doc = json.loads(summary.read_text())
        except json.JSONDecodeError:
            doc = None
        for key in ("expert_imbalance_per_layer", "expert_imbalance"):
            value = _number(doc.get(key)) if isinstance(doc, dict) else None
            if value is not None:
                return value, f"{summary} {key}"
    metrics = root / "metrics.jsonl"
    steps: list[float] = []
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(row, dict):
                continue
            value = _number(row.get("expert_imbalance_per_layer", row.get("expert_load_imbalance")))
            if value is not None:
                steps.append(value)
    if steps:
        return sum(steps) / len(steps), f"{metrics} (mean of {len(steps)} logged steps)"
    raise PlanError(f"--from-run {str(run_dir)!r}: no expert_imbalance in summary.json and no "
                    "expert_load_imbalance in metrics.jsonl (was it an MoE run?); pass --moe-imbalance instead")
