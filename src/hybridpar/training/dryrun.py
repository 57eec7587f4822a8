"""``hybridpar train --dry-run``: one rank's share of a real-size model for a world of N,
trained for real steps with neither memory nor compute, measured beside the planner.

Each chosen rank runs in this process, one after another: torch's fake process group plays
rank ``r`` of ``N`` (every collective keeps its shapes and moves nothing; the mesh's groups are
built as on a cluster), and under ``FakeTensorMode`` the :class:`~hybridpar.training.trainer.Trainer`
builds the rank's share of the model (tensor, pipeline, context, expert and ZeRO splits
applied as in a real run) and runs ``Trainer.train_step``: forward, backward, gradient sync,
clipping and the optimizer, in the run's dtype. The first step warms up (the optimizer state
appears in it); the last one is measured:

* the payload bytes per mesh axis the :class:`~hybridpar.distributed.comm.Comm` layer counts,
  beside :func:`hybridpar.planner.price.traffic.comm_bytes_per_axis` (equal to the byte; through
  :func:`hybridpar.training.plancheck.planned_traffic`, as every real run checks it);
* FLOPs (``FlopCounterMode``, with the CPU fused attention kernel counted as the GPU's),
  beside :func:`predicted_flops`, built from the model's per-layer FLOPs and the planner's
  partition (equal);
* the peak of live tensor bytes (torch's ``MemTracker``, by kind), beside the planner's tensor
  term (:mod:`hybridpar.training.dryrun_memory`).

The report and its formats are in :mod:`hybridpar.training.dryrun_report`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from hybridpar import compat
from hybridpar.config import Config, ConfigError, ModelConfig
from hybridpar.distributed.mesh import ParallelDims, Topology
from hybridpar.parallel.context import RingPlan
from hybridpar.planner.model.layout import Layout, Workload, from_config, model_key
from hybridpar.planner.model.mla import mla_core_width
from hybridpar.planner.model.shapes import layer_partition, v_shaped
from hybridpar.training.dryrun_memory import LiveBytes, planned_memory
from hybridpar.training.plancheck import planned_traffic
from hybridpar.training.trainer import Trainer


@dataclass
class RankRun:
    """One dry-run rank: where it sits, why it was chosen, and each measure beside the planner's."""

    rank: int
    coords: dict[str, int]
    why: str
    traffic: dict[str, int] = field(default_factory=dict)  # {axis: payload bytes} of the measured step
    traffic_planned: dict[str, int] = field(default_factory=dict)
    flops: int = 0
    flops_planned: int = 0
    memory: dict[str, int] = field(default_factory=dict)  # peak live tensor bytes by kind, and "total"
    memory_planned: dict[str, float] = field(default_factory=dict)  # the planner's terms, and "tensors"
    seconds: float = 0.0

    def traffic_diff(self) -> dict[str, int]:
        """``measured - planned`` payload bytes per axis (axes either side names)."""
        axes = sorted(set(self.traffic) | set(self.traffic_planned))
        return {a: self.traffic.get(a, 0) - self.traffic_planned.get(a, 0) for a in axes}

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "traffic_diff": self.traffic_diff(),
                "flops_diff": self.flops - self.flops_planned}


def default_ranks(cfg: Config) -> list[tuple[int, str]]:
    """The ranks that differ, each with why: the first pipeline stage (embedding), the last
    (head and loss), a middle one, an expert-parallel rank (the last ep coordinate) and the rank
    that gets the uneven remainder of the ZeRO shards (the last dp x cp coordinate)."""
    p = cfg.parallel
    dims = ParallelDims.from_config(p)
    last_dp, last_cp = p.dp - 1, p.cp - 1
    picks = [(0, "first pipeline stage (embedding)" if p.pp > 1 else "rank 0")]
    if p.pp > 1:
        picks.append((dims.rank_of(pp=p.pp - 1), "last pipeline stage (head, loss)"))
    if p.pp > 2:
        picks.append((dims.rank_of(pp=p.pp // 2), "middle pipeline stage"))
    if p.ep > 1:  # ep is carved from dp x cp: its last coordinate is the last ep rank of the first group
        picks.append((dims.rank_of(dp=(p.ep - 1) // p.cp, cp=(p.ep - 1) % p.cp), "expert-parallel rank"))
    if p.dp * p.cp > 1:
        picks.append((dims.rank_of(pp=p.pp - 1, dp=last_dp, cp=last_cp, tp=p.tp - 1),
                      "last ZeRO / data-parallel shard (uneven remainder)"))
    seen: dict[int, str] = {}
    for r, why in picks:
        seen[r] = f"{seen[r]}; {why}" if r in seen else why
    return list(seen.items())


def parse_ranks(text: str, world: int) -> list[int]:
    """``--ranks 0,7,12``: the ranks to dry-run, each in ``[0, world)``."""
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--ranks {text!r} must be comma-separated integers, e.g. --ranks 0,7") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or not ranks:
        raise ConfigError(f"--ranks {text!r}: each rank must be in [0, {world}) (the world of {world} processes)")
    return ranks


def predicted_flops(cfg: Config, layout: Layout, work: Workload, pp_rank: int, cp_rank: int = 0) -> int:
    """FLOPs one rank (pipeline rank ``pp_rank``, cp rank ``cp_rank``) executes in a step, counted
    as ``FlopCounterMode`` counts them.

    Matmuls: the model FLOPs per token of its layers and head (6 x the matmul parameters a token
    uses, :meth:`~hybridpar.config.ModelConfig.layer_flops` without PaLM's attention term) times
    its ``global_batch * seq / (dp * cp)`` tokens, over tp. Attention: 4 (forward) + 10 (backward,
    which recomputes the scores) x ``head_dim`` per computed score entry and head: the fused
    kernel computes a causal ``s x s`` block whole (PaLM's ``12 dim s`` per token counts 12, over
    ``dim`` rather than the query width); ring attention computes the blocks its
    :class:`~hybridpar.parallel.context.RingPlan` does not skip (``work``), on
    ``n_heads / (tp * ulysses)`` heads. Recomputation: ``full`` reruns a layer's forward up to
    the last tensor its backward needs (torch's checkpoint stops early: the down projection's
    output, an MoE layer's shared experts' one, is never recomputed, but for an FP8 one, whose operands are saved when it returns), ``selective`` the attention forward; the chunked loss
    (``train.loss_chunk_tokens`` below a micro-batch's tokens) the head's forward."""

    model, S, p = cfg.model, work.seq_len, cfg.parallel
    chunks = layer_partition(model_key(model), layout.pp, layout.virtual_stages if layout.pp > 1 else 1,
                             layout.pp > 1 and v_shaped(layout.pipeline_schedule)).for_rank(pp_rank)
    layers = [i for c in chunks for i in c.layers]
    tokens = work.global_batch * S // (layout.dp * layout.cp)
    matmul = [model.layer_flops(i, S) - model.score_flops(S) for i in layers]
    ulysses, ring = p.cp_split() if layout.cp > 1 else (1, 1)
    scores = S * S if ring == 1 else RingPlan.for_layout(S, ring, cp_rank // ulysses).work
    heads = model.n_heads / (layout.tp * ulysses)
    width = mla_core_width(model)[1] if model.mla else model.head_dim  # MLA: values padded to qk
    attn_fwd = 4.0 * width * heads * scores * (work.global_batch // layout.dp)  # per layer, this rank
    total = sum(matmul) * tokens / layout.tp + 3.5 * attn_fwd * len(layers)
    if layout.recompute == "full":
        early = work.fp8 == "none"  # an FP8 linear's operands are saved as its Function returns, after its GEMM
        shared = 2.0 * model.dim * model.n_shared_experts * model.expert_hidden  # an MoE layer's last matmul (bf16)
        down = [(2.0 * model.dim * model.ffn_hidden if early else 0.0) if i not in model.moe_layer_ids() else shared
                for i in layers]
        total += sum(f / 3 - d for f, d in zip(matmul, down, strict=True)) * tokens / layout.tp
    if layout.recompute in ("full", "selective"):
        total += attn_fwd * len(layers)
    chunked = 0 < work.loss_chunk_tokens < layout.micro_batch * S // layout.cp  # the chunked loss's
    head = model.head_flops() * (4 / 3 if chunked else 1)  # backward projects each chunk again
    total += sum(head for c in chunks if c.head) * tokens / layout.tp
    if model.mtp_layers and any(c.head for c in chunks):
        total += _mtp_flops(model, S, tokens, layout.tp, head) + 3.5 * attn_fwd * model.mtp_layers
    return round(total)


def _mtp_flops(model: ModelConfig, seq: int, tokens: int, tp: int, head: float) -> float:
    """The matmul FLOPs of the multi-token prediction modules on this rank's ``tokens`` (of
    sequences of ``seq``; forward and backward, never recomputed): per module its ``[2 dim ->
    dim]`` projection, decoder layer (an MoE layer's when the model has experts) and the shared
    head (``head`` FLOPs per token: the chunked loss's included) on every token (those without a
    target in the sequence are ignored by the loss, not left out of the matmul)."""
    like = model.moe_layer_ids()[0] if model.n_experts else -1  # -1: a dense layer
    block = 12.0 * model.dim * model.dim + model.layer_flops(like, seq) - model.score_flops(seq)
    return model.mtp_layers * (block + head) * tokens / tp


def run_rank(cfg: Config, rank: int, why: str, steps: int = 2) -> RankRun:
    """Dry-run ``rank`` of ``cfg``'s world: ``steps`` training steps, the last one measured."""
    start = time.perf_counter()
    layout, work = from_config(cfg)
    compat.init_fake_process_group(rank, cfg.parallel.world_size)
    try:
        with (ParallelDims.from_config(cfg.parallel).build("cpu") as topo, compat.fake_tensor_mode(),
              LiveBytes() as memory):
            trainer = Trainer(cfg, topo)
            for step in range(1, steps):
                trainer.train_step(step)
            topo.comm.counter.reset()
            flops = compat.flop_counter()  # no module tracker: it would keep recomputed blocks' tensors
            memory.mark(trainer.model)
            with flops:
                trainer.train_step(steps)
            out = RankRun(rank, dict(topo.coords), why, traffic=_traffic(topo), flops=flops.get_total_flops(),
                          memory=memory.measured())
            pp_rank, zero_rank, cp_rank = topo.pp.rank, topo.dp_cp.rank, topo.cp.rank
    finally:
        dist.destroy_process_group()
    out.traffic_planned = planned_traffic(cfg, pp_rank, zero_rank, ep_load=1.0)  # what every real run checks too
    out.flops_planned = predicted_flops(cfg, layout, work, pp_rank, cp_rank)
    out.memory_planned = planned_memory(cfg.model, layout, work, pp_rank)
    out.seconds = time.perf_counter() - start
    return out


def _traffic(topo: Topology) -> dict[str, int]:
    """Payload bytes per axis the counter recorded (axes that moved nothing left out)."""
    counter = topo.comm.counter
    axes = {key.split("/")[1] for key in counter.snapshot()}
    return {a: counter.bytes(axis=a) for a in sorted(axes) if counter.bytes(axis=a)}


def dry_run(cfg: Config, ranks: list[tuple[int, str]] | None = None, steps: int = 2) -> list[RankRun]:
    """Dry-run ``ranks`` (default :func:`default_ranks`) of ``cfg``'s layout, one after another."""
    if steps < 1:
        raise ConfigError(f"--steps {steps} must be >= 1 (the last step is measured, those before warm up)")
    if dist.is_initialized():
        raise RuntimeError("the dry run plays ranks on torch's fake process group: call it where no process "
                           "group is initialized (not inside a launched training process)")
    return [run_rank(cfg, r, why, steps) for r, why in (ranks or default_ranks(cfg))]
