"""The engine: one model and its optimizer under a layout.

This is the one place that applies the parallel axes to a model, through its family
(:mod:`hybridpar.models.registry`): tensor parallelism shards its layers (``family.parallelize``),
context parallelism swaps in ring attention for its attention cores, pipeline parallelism cuts
it into this rank's chunks (``family.make_chunk``) and runs a schedule, and data parallelism
averages gradients over dp x cp. The Trainer above it only feeds micro-batches,
clips, steps and logs; it branches on nothing.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from hybridpar.config import Config
from hybridpar.distributed.mesh import Topology
from hybridpar.models.common import Documents
from hybridpar.models.hf import init_from_hf
from hybridpar.models.lazy import Narrowed
from hybridpar.models.moe import moe_layers, update_balance_bias
from hybridpar.models.registry import family_of
from hybridpar.parallel.compile import compile_blocks
from hybridpar.parallel.context import zigzag_positions
from hybridpar.parallel.context_model import enable_context_parallel
from hybridpar.parallel.experts import expert_param_names, expert_units, sum_over_axes
from hybridpar.parallel.pipeline import build_schedule, partition_model
from hybridpar.parallel.pipeline.runtime import PipelineRunner
from hybridpar.parallel.pipeline.stages import (
    build_stage_modules,
    owned_named_parameters,
    sync_tied_embedding_grads,
    tied_embedding_weight,
)
from hybridpar.parallel.pipeline.twobw import TwoBWRunner
from hybridpar.parallel.recompute import apply_recompute
from hybridpar.parallel.tensor import gather_logits, vocab_parallel_cross_entropy
from hybridpar.parallel.tensor_plan import set_sequence_parallel
from hybridpar.parallel.zero import (
    COMPRESSION_DTYPES,
    ExpertSplitOptimizer,
    OuterSplit,
    ShardedModel,
    StageSharded,
    ZeroOptimizer,
    decay_groups,
    shard_model,
    shard_stages,
)
from hybridpar.training.generate import sample
from hybridpar.training.precision import autocast
from hybridpar.training.step import StepEngine

Batch = tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Documents]  # (inputs, targets[, packed documents])


class Engine(StepEngine):
    """This rank's share of a model family under ``cfg``'s layout, on the shared step mechanics
    (:class:`~hybridpar.training.step.StepEngine`): built here, trained there."""

    def __init__(self, cfg: Config, topo: Topology, device: torch.device) -> None:
        self.cfg, self.topo, self.device = cfg, topo, device
        m, p, t = cfg.model, cfg.parallel, cfg.train
        self.family = family = family_of(m)
        self.plan = plan = family.tp
        model = family.build(m).to(device)
        model.init_weights(t.seed)
        self.sequence_parallel = p.sequence_parallel and topo.tp.size > 1
        family.parallelize(model, topo.tp, self.sequence_parallel)  # no-op at tp=1
        if family.parallelize_moe is not None:  # MoE layers: experts over ep (and tp), token counts
            tokens = [topo.cp, *([topo.tp] if self.sequence_parallel else [])]
            family.parallelize_moe(model, topo.tp, topo.ep, tokens, self.sequence_parallel)
        self.expert_names = expert_param_names(model) if topo.ep.size > 1 else set()
        if t.init_from:  # shape checked against cfg.model; each tp (and ep) rank reads only its slices
            init_from_hf(model, t.init_from, m, read=self._read_shard)
        self.cp = (enable_context_parallel(model, topo.cp, family.attention_modules(model))
                   if topo.cp.size > 1 else None)
        # train.compile: the blocks' math; recomputation (below) reruns the compiled forward
        self.compiled = compile_blocks(family.blocks(model), t.compile_backend) if t.compile else 0
        # after cp: selective reruns ring attention's core too
        apply_recompute(model, p.recompute, family.blocks(model), family.attention_modules(model))
        self.model = model
        runner: PipelineRunner | None = None
        if topo.pp.size > 1:
            self.partition = partition_model(m, p.pp, p.virtual_stages, v_shape=p.pipeline_schedule == "zbv",
                                             layer_counts=p.layer_counts())
            self.chunks = build_stage_modules(model, family.make_chunk, topo.pp.rank, p.pp, p.virtual_stages,
                                              self.partition)
            for chunk in self.chunks:
                chunk.sequence_shards = topo.tp.size if self.sequence_parallel else 1
            if self.cp is not None:  # chunks bypass the model's forward hook: set cp's plan here
                self.cp.plan = self.cp.plan_for(t.seq_len, device)
                for chunk in self.chunks:
                    chunk.positions = zigzag_positions(t.seq_len, topo.cp).to(device)
            # what crosses a stage boundary: this rank's share of the sequence (cp, then SP)
            seq = t.seq_len // topo.cp.size // (topo.tp.size if self.sequence_parallel else 1)
            stage = dict(act_shape=(t.micro_batch, seq, m.dim), forward_context=lambda: autocast(t.precision, device))
            if p.pipeline_schedule == "2bw":  # asynchronous: two weight versions, one step of delay
                runner = TwoBWRunner(self.chunks, topo, cfg.microbatches, self.loss_from_logits, **stage)
            else:
                schedule = build_schedule(p.pipeline_schedule, p.pp, p.virtual_stages, cfg.microbatches)
                runner = PipelineRunner(self.chunks, topo, schedule, self.loss_from_logits, **stage)
            owned = owned_named_parameters(self.chunks)
            train = list({id(q): q for c in self.chunks for q in c.parameters()}.values())  # tied mirror too
        else:
            self.chunks = []
            owned = list(model.named_parameters())
            train = [q for _, q in owned]
        bucket = int(p.bucket_mb * 2**20)
        # One data-parallel path: ZeroOptimizer at every stage over dp x cp, the ranks that hold
        # replicas and average gradients. Stage 0 is plain bucketed data parallelism (optionally
        # hierarchical), 1-3 shard optimizer state, + gradients, + parameters. Under tp the
        # shards are rows of each rank's tp piece; under pp each stage shards what it trains.
        outer = OuterSplit(topo.tp, plan.shard_dim) if topo.tp.size > 1 else None
        # Prefetching the next unit's gather overlaps it with compute on GPUs (separate comm
        # streams); on CPU the collective runs on the same cores, so it only adds a unit of
        # peak memory (as FSDP2, which prefetches only with CUDA streams).
        prefetch = device.type == "cuda"
        ids = {id(q) for q in train}
        names = {n for n, q in model.named_parameters() if id(q) in ids}
        experts = [(n, q) for n, q in model.named_parameters() if n in self.expert_names]
        expert_ids = frozenset(id(q) for _, q in experts)
        sharded: ShardedModel | None = None
        if p.zero_stage == 3 and runner is not None:  # per stage, gathered once per step (runner's hooks)
            tied = tied_embedding_weight(self.chunks)  # its two copies' gradients are summed after the pipeline
            sharded = shard_stages(model, topo.dp_cp, self.chunks, outer=outer,
                                   hold=frozenset() if tied is None else frozenset({id(tied)}))
            runner.stage_hooks = sharded
        elif p.zero_stage == 3:
            sharded = shard_model(model, topo.dp_cp, family.zero3_units(model), prefetch=prefetch, outer=outer,
                                  skip=expert_ids)
        split = OuterSplit(topo.ep, lambda n: 0, inner=outer)  # experts: their rows over ep, then tp's split
        expert_sharded = (shard_model(model, topo.edp, expert_units(model), prefetch=prefetch, outer=split,
                                      skip=frozenset(id(q) for q in model.parameters()) - expert_ids)
                          if p.zero_stage == 3 and experts else None)
        named = [(n, q) for n, q in model.named_parameters() if n in names]  # ZeRO-3: the shards
        hierarchy = None
        if p.zero_stage == 0 and p.hierarchical_dp and topo.dp_cp.size > 1:  # node boundaries from the launcher
            node = p.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", topo.world_size))
            hierarchy = topo.node_split(topo.dp_cp, node)
        opts = dict(stage=p.zero_stage, offload=p.offload_optimizer, bucket_bytes=bucket,
                    reduce_dtype=COMPRESSION_DTYPES[p.grad_compression], offload_to=p.offload_to,
                    offload_dir=p.offload_dir or None, offload_params=p.offload_params,
                    lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
        dense = [(n, q) for n, q in named if n not in self.expert_names]
        optimizer = ZeroOptimizer(decay_groups(dense, t.weight_decay), topo.dp_cp, sharded=sharded, outer=outer,
                                  hierarchy=hierarchy, **opts)
        if self.expert_names:  # experts average over the ranks holding the same ones (edp)
            experts = [(n, q) for n, q in named if n in self.expert_names]  # ZeRO-3: the shards
            optimizer = ExpertSplitOptimizer(optimizer, ZeroOptimizer(decay_groups(experts, t.weight_decay), topo.edp,
                                                                      sharded=expert_sharded, outer=split, **opts),
                                             topo.ep)
        self.params = [q for _, q in named if q.requires_grad]
        # gradients that are partial sums over tp after backward (all replicated ones under SP)
        ids = {id(q) for q in self.params}
        partial = {n for n, q in model.named_parameters() if id(q) in ids and plan.needs_tp_sum(n, self.sequence_parallel)}
        # the loss is looked up per call, so a subclass or a test may replace self.loss
        super().__init__(topo, optimizer, plan, owned, loss=lambda *batch: self.loss(*batch), runner=runner,
                         tp_partial=partial, after_pipeline=lambda: sync_tied_embedding_grads(self.chunks, topo))
        self.on_grad_scale = self._start_step
        self.moe = moe_layers(model)
        self._load: Tensor | None = None  # this step's expert load over all ranks, once collected

    # ------------------------------------------------------------------ mixture of experts
    def _start_step(self, scale: float) -> None:
        """A step's backward is about to run with gradient scale ``scale``."""
        aux = getattr(self.model, "moe_aux", None)
        if aux is not None:
            aux.grad_scale = scale
        self._load = None

    def _read_shard(self, name: str, lazy: Any) -> Tensor:
        """This rank's part of HF tensor ``name``: its experts (ep) of their tp piece."""
        if name in self.expert_names:
            ep, n = self.topo.ep, self.cfg.model.n_experts // self.topo.ep.size
            lazy = Narrowed(lazy, 0, ep.rank * n, (ep.rank + 1) * n)  # read only these experts' rows
        return self.plan.read_shard(name, lazy, self.topo.tp)

    def _step_load(self) -> Tensor:
        """``[MoE layers, experts]``: tokens routed to each expert this step over all ranks (each
        tp rank routed its sequence chunk under SP; a layer runs on one pp stage); collective,
        once per step, and the routers' counters restart."""
        if self._load is None:
            topo = self.topo
            load = torch.stack([moe.router.load for moe in self.moe])  # other stages' layers: zeros
            for moe in self.moe:
                moe.router.load.zero_()
            axes = [topo.tp] if self.sequence_parallel else []
            self._load = sum_over_axes([*axes, topo.pp, topo.dp_cp], load)
        return self._load

    def update(self, max_norm: float) -> Tensor:
        """The optimizer step, then (MoE with ``bias_update_rate``) the balancing bias update
        from the step's load over all ranks."""
        norm = super().update(max_norm)
        rate = self.cfg.model.bias_update_rate
        if rate > 0 and self.moe:
            update_balance_bias(self.moe, self._step_load(), rate)
        return norm

    # ------------------------------------------------------------------ 2BW's second weight version
    def weight_versions_state(self) -> dict[str, Tensor]:
        """2BW: the stale weight version (the one the next step's batch runs on, module doc of
        :mod:`hybridpar.parallel.pipeline.twobw`) by parameter name, placed as a checkpoint places
        the model's weights (tp pieces as DTensors, so another layout can read it); empty for the
        synchronous schedules."""
        if not isinstance(self.runner, TwoBWRunner):
            return {}
        placed = self.optimizer.checkpoint_state(self.model)["model"]  # the newest, as checkpoints hold it
        out: dict[str, Tensor] = {}
        for name, t in zip(self.runner.versions.names, self.runner.versions.stale, strict=True):
            ref = placed[name]
            out[name] = (DTensor.from_local(t, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape,
                                            stride=ref.stride()) if isinstance(ref, DTensor) else t)
        return out

    def load_weight_versions(self, state: dict[str, Tensor] | None) -> None:
        """2BW after a checkpoint load: the stale version from ``state`` (a
        :meth:`weight_versions_state` filled by the load), or, from a synchronous schedule's
        checkpoint (None), equal to the loaded weights, as at a start."""
        if not isinstance(self.runner, TwoBWRunner):
            return
        versions = self.runner.versions
        if state is None:
            state = dict(zip(versions.names, versions.newest, strict=True))
        versions.load_stale({n: t.to_local() if isinstance(t, DTensor) else t for n, t in state.items()})

    def moe_step_stats(self, microbatches: int) -> dict[str, Any] | None:
        """The step's MoE statistics over all ranks (None for a dense model); collective (every
        rank, every step, after the backward). ``expert_load``: tokens routed to each expert per
        MoE layer (every layer, whichever stage holds it); ``expert_load_imbalance``: the worst
        layer's max/mean load; ``dropped_tokens``: routed slots short of tokens x k (0: the
        layers are dropless); ``aux_loss``: the auxiliary losses' sum over layers, mean over
        micro-batches."""
        if not self.moe:
            return None
        topo = self.topo
        load = self._step_load()
        aux = torch.tensor([self.model.moe_aux.value], dtype=torch.float64)
        self.model.moe_aux.reset()
        sum_over_axes([topo.tp] if self.sequence_parallel else [], aux)  # SP: each tp rank's share
        topo.comm.all_reduce(aux, topo.pp)
        topo.comm.all_reduce(aux, topo.dp_cp, op="avg")
        t, m = self.cfg.train, self.cfg.model
        slots = t.global_batch * t.seq_len * m.experts_per_token
        per_layer = (load.max(1).values / load.mean(1)).tolist()
        return {"aux_loss": float(aux) / microbatches, "expert_load_imbalance": max(per_layer),
                "expert_imbalance_per_layer": per_layer,
                "dropped_tokens": int(slots * len(self.moe) - load.sum().item()),
                "expert_load": load.long().tolist()}

    # ------------------------------------------------------------------ loss
    def loss_from_logits(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy of this rank's tokens (fp32; vocab-sharded under tp,
        never gathered). Under cp every rank holds equally many tokens, so the cp average of
        these means is the mean over whole sequences."""
        return vocab_parallel_cross_entropy(logits.float(), targets, self.topo.tp, self.cfg.model.vocab_size)

    def loss(self, inputs: Tensor, targets: Tensor, docs: Documents | None = None) -> Tensor:
        """Loss of one micro-batch through the whole (non-pipelined) model; ``docs``: its packed
        documents (``train.document_mask``), this rank's tokens of them."""
        positions = zigzag_positions(self.cfg.train.seq_len, self.topo.cp) if self.cp is not None else None
        with autocast(self.cfg.train.precision, self.device):
            logits = self.model(inputs, positions) if docs is None else self.model(inputs, positions, docs=docs)
        return self.loss_from_logits(logits, targets)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> Tensor:
        """Per-micro-batch losses, forward only."""
        if self.runner is not None:
            return self.runner.evaluate(batches)
        self.model.eval()
        try:
            return torch.stack([self.loss(*batch) for batch in batches])
        finally:
            self.model.train()

    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole model's weights as one process would hold them (collective: every rank
        calls it; pipeline stages share, tensor and ZeRO-3 shards are gathered)."""
        pieces = self.optimizer.gather_full_state_dict()  # ZeRO-3 rows (experts': over edp) -> tp pieces
        if pieces is not None:  # -> (pp: each stage's, shared) -> full
            self._share_pipeline_weights(pieces)
            keep = set(self.model.state_dict())  # not the non-persistent buffers (MoE routers' step counts)
            full = {n: self.plan.gather_full(n, t, self.topo.tp, self.cfg.model.vocab_size) for n, t in pieces.items()
                    if n in keep}
        else:
            self._share_pipeline_weights()
            full = self.plan.gather_full_state_dict(self.model, self.topo.tp, self.cfg.model.vocab_size)
        for name in self.expert_names:  # experts: every ep rank's
            full[name] = self.topo.comm.all_gather(full[name], self.topo.ep, 0)
        return full

    # ------------------------------------------------------------------ sampling, timeline
    def sample(self, prompt: list[int], max_new_tokens: int, seed: int) -> list[int]:
        """Sample on every rank together: pp stages first share their weights, tp ranks gather
        logits (same seed, same tokens), cp ranks attend locally."""
        sharded = self.optimizer.sharded
        whole = sharded.gathered() if isinstance(sharded, StageSharded) else contextlib.nullcontext()
        tp, vocab = self.topo.tp, self.cfg.model.vocab_size
        paused = self.cp.paused() if self.cp is not None else contextlib.nullcontext()
        set_sequence_parallel(self.model, False)  # any prompt length
        try:
            with whole, paused:
                self._share_pipeline_weights()
                return sample(self.model, prompt, max_new_tokens, self.cfg.model.max_seq_len, seed=seed,
                              forward=lambda x: gather_logits(self.model(x), tp, vocab))
        finally:
            set_sequence_parallel(self.model, self.sequence_parallel)

    @torch.no_grad()
    def _share_pipeline_weights(self, tensors: dict[str, Tensor] | None = None) -> None:
        """Broadcast each stage's trained weights over pp so every rank holds the whole model:
        the model's parameters, or ``tensors`` (name -> full tensor, ZeRO-3's gathered ones)."""
        if self.runner is None:
            return
        pp = self.topo.pp
        owner: dict[str, int] = {}
        for r in range(pp.size):
            chunks = build_stage_modules(self.model, self.family.make_chunk, r, pp.size,
                                         self.cfg.parallel.virtual_stages, self.partition)
            for name, _ in owned_named_parameters(chunks):
                owner.setdefault(name, r)
        for name, param in self.model.named_parameters():
            self.topo.comm.broadcast(param.data if tensors is None else tensors[name], pp, src=owner[name])

    def save_timeline(self, path: Path, is_logger: bool) -> tuple[Path, float] | None:
        """Draw the last pipeline step as recorded (collective over pp; rank 0 writes); returns
        the picture's path and the recorded bubble fraction (None without pp)."""
        if self.runner is None or self.last_pipeline_step is None:
            return None
        from hybridpar.parallel.pipeline.timeline import plot_timeline

        timeline = self.runner.gather_timeline(self.last_pipeline_step)
        return (plot_timeline(timeline, path) if is_logger else path), timeline.bubble_fraction
