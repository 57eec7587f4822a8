"""The training loop: one object owns model, optimizer, data and layout for a run.

``train_step`` is one optimizer step over the global batch; ``forward_backward_step`` is one
micro-batch. Parallel axes enter in exactly two places: which sample ids this rank reads, and
how gradients and the logged loss are reduced.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from hybridpar.config import Config
from hybridpar.data.corpus import WindowSampler
from hybridpar.data.errors import check_vocab
from hybridpar.data.mixture import MixtureSampler, open_training_data
from hybridpar.distributed import device as devices
from hybridpar.distributed.lifecycle import StopRequest
from hybridpar.distributed.mesh import Topology
from hybridpar.models.common import Documents
from hybridpar.parallel.context import zigzag_positions, zigzag_shard
from hybridpar.training import checkpoint, elastic, plancheck
from hybridpar.training.checkpoint import snapshot
from hybridpar.training.elastic import LayoutChange
from hybridpar.training.engine import Engine
from hybridpar.training.errors import NonFiniteLossError
from hybridpar.training.features import Launch, RunContext, components_for
from hybridpar.training.features.async_checkpoint import AsyncCheckpoint
from hybridpar.training.features.base import UpdateOutcome
from hybridpar.training.loop import (
    Checkpointing,
    Evaluation,
    LastStepTraffic,
    LossRange,
    RunReport,
    StepResult,
    ThroughputMeter,
    log_due,
    step_record,
)
from hybridpar.training.metrics import METRICS_FILE, MetricsLogger, atomic_write_text
from hybridpar.training.optim import lr_at
from hybridpar.training.precision import LossScaler, record_nonfinite
from hybridpar.training.rundir import backup_previous_run

STEPPED = UpdateOutcome()  # an update that stepped, the loss scale unchanged


class Trainer:
    """Trains ``cfg.model`` under the layout in ``topo`` on ``cfg.train.data``."""

    def __init__(self, cfg: Config, topo: Topology, device: torch.device | None = None,
                 stop: StopRequest | None = None, elastic: LayoutChange | None = None) -> None:
        self.cfg = cfg
        self.device = device or torch.device("cpu")
        # this process before data and model: the baseline of the plan check's CPU resident-set model
        self.host_baseline = float(devices.memory_bytes(self.device)) if self.device.type == "cpu" else None
        self.elastic = elastic  # an elastic job's layout for this world: recorded in layouts.json
        self.stop = stop  # a signal asks for a checkpoint and a clean stop after the current step
        self.topo = topo
        t = cfg.train
        self.data = open_training_data(t.data, t.seq_len, t.seed)  # one dataset or a weighted mixture
        self.tokenizer = self.data.tokenizer
        check_vocab(self.data.vocab_size, cfg.model.vocab_size)
        self.train_data, self.val_data = self.data.train, self.data.val
        # the run's features as components, decided once (training/features/): the engine runs
        # their build steps, this loop their step hooks
        self.hooks = components_for(cfg, Launch(elastic=elastic))
        self.engine = Engine(cfg, topo, self.device, self.hooks)
        self.model, self.optimizer, self.params = self.engine.model, self.engine.optimizer, self.engine.params
        self.cp = self.engine.cp
        self.scaler = LossScaler(t.precision == "fp16", t.loss_scale_init, t.loss_scale_window)
        self.skipped_nonfinite = 0
        self._nonfinite: torch.Tensor | None = None  # [step, loss] of the first NaN/Inf loss, on the device
        self._latest: StepResult | None = None  # fit's latest step (its values may be on the device)
        self.is_logger = topo.rank == 0
        self.run_dir = Path(t.run_dir)
        self.checkpoint_stalls: list[tuple[int, float]] = []  # (step, seconds training waited to save it)
        self.hooks.attach(RunContext(self.engine, topo, self.device, self.run_dir, self.is_logger,
                                     lambda step: self.micro_batches(step, t.global_batch, self.train_data),
                                     t.timeout_s, self.checkpoint_stalls, extra_state=self._extra_state))
        # async_checkpoint.enabled: its component's thread copies each save to host memory and writes it
        staging = self.hooks.find(AsyncCheckpoint)
        self.writer = staging.writer if staging is not None else None

    # ------------------------------------------------------------------ data
    def micro_batches(self, step: int, per_step: int,
                      sampler: WindowSampler | MixtureSampler) -> list[tuple]:
        """This rank's micro-batches of step ``step`` (from 1) when a step reads ``per_step``
        global sample ids: the dp axis takes contiguous equal shares of the ids, and the cp axis
        its zigzag share of each sequence's tokens. With ``train.document_mask`` each is
        ``(x, y, Documents)`` (document labels and positions, sharded like the tokens)."""
        dp = self.topo.dp
        share = per_step // dp.size
        first = (step - 1) * per_step + dp.rank * share
        mb = self.cfg.train.micro_batch
        out = []
        for start in range(first, first + share, mb):
            x, y = sampler.batch(range(start, start + mb))
            docs = None  # train.document_mask: labels and RoPE positions of whole sequences
            if self.cfg.train.document_mask:
                docs = Documents.from_segments(sampler.doc_ids(range(start, start + mb)))
            if self.cp is not None:
                x, y = zigzag_shard(x, self.topo.cp, dim=1), zigzag_shard(y, self.topo.cp, dim=1)
                if docs is not None:  # sharded like the tokens
                    docs = docs.index_select(1, zigzag_positions(self.cfg.train.seq_len, self.topo.cp))
            if docs is None:
                out.append((self._to_device(x), self._to_device(y)))
            else:
                out.append((self._to_device(x), self._to_device(y), docs.to(self.device)))
        return out

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the training device. To a GPU from pinned memory without blocking: a blocking
        copy from pageable memory makes the host wait for the device's queue (the previous
        step's kernels) before every step; the fresh host tensor is not written again."""
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def train_step(self, step: int) -> StepResult:
        """One optimizer step over the global batch; returns the global mean loss.

        The step is skipped (no weight or optimizer-state change, on every rank alike) when fp16
        gradients overflow, or when the loss is NaN/Inf and ``train.nonfinite = "skip"``.

        Device synchronizations: fp32/bf16 with ``train.nonfinite = "stop"``: none; the loss and
        the gradient norm stay on the device in the :class:`StepResult` (read when logged), and a
        non-finite loss is recorded there on the device and raised by ``fit`` at the next step
        whose values it reads (a log, evaluation or checkpoint step, before anything is saved).
        fp16 or ``"skip"``: one, the overflow flag, loss and norm read together to decide."""
        t = self.cfg.train
        lr = lr_at(step, t)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=False)
        batches = self.hooks.batches(step)  # a feature may have read them already
        if batches is None:
            batches = self.micro_batches(step, t.global_batch, self.train_data)
        self.hooks.start_step(step, batches)
        # fp16: each rank scales its micro-batches as one process scales all M x replicas of them,
        # so the same values overflow fp16 under every layout; the dp average is then 1/replicas
        # of the scaled sum, which unscaling undoes (fp32/bf16: the plain 1/M mean, no rescaling)
        replicas = self.topo.dp_cp.size if self.scaler.enabled else 1
        loss = self.engine.forward_backward(batches, self.scaler.scale / (len(batches) * replicas)).mean().float()
        stats = self.hooks.after_backward(step, len(batches))  # statistics for the record (collective)
        self.topo.comm.all_reduce(loss, self.topo.dp_cp, op="avg")  # NaN on any rank reaches all
        overflow = self.scaler.unscale(self.engine.gradients(), self.topo.world, replicas)  # fp16: on the device
        norm = self.engine.grad_norm()  # global norm, on the device (collective)
        if overflow is not None or t.nonfinite == "skip":
            return self._decided_update(step, lr, loss, norm, overflow, stats)
        self._nonfinite = record_nonfinite(self._nonfinite, step, loss)
        self._update(step, norm)
        return StepResult(loss, norm, lr, stats=stats, nonfinite=self._nonfinite)

    def _decided_update(self, step: int, lr: float, loss: torch.Tensor, norm: torch.Tensor,
                        overflow: torch.Tensor | None, stats: Any) -> StepResult:
        """fp16 or ``train.nonfinite = "skip"``: read the overflow flag, loss and norm in one
        transfer (the step's one synchronization) and skip, stop or update as they say."""
        flag = overflow if overflow is not None else torch.zeros(1, device=loss.device)
        overflowed, loss_v, norm_v = torch.cat([flag.reshape(1).float(), loss.reshape(1).float(),
                                                norm.reshape(1).float()]).tolist()
        factor, clean = 1.0, True
        if overflow is not None:
            scale = self.scaler.scale
            clean = self.scaler.decide(overflowed > 0, self.engine.gradients())
            factor = self.scaler.scale / scale
            if not clean:
                self.hooks.after_update(step, UpdateOutcome(stepped=False, scale_factor=factor, finite=False))
                return StepResult(loss=loss_v, grad_norm=0.0, lr=lr, skipped=True)
        if not math.isfinite(loss_v):
            self._on_nonfinite(step, loss_v)
            self.hooks.after_update(step, UpdateOutcome(stepped=False, scale_factor=factor))
            return StepResult(loss=loss_v, grad_norm=0.0, lr=lr, skipped=True)
        self._update(step, norm, UpdateOutcome(scale_factor=factor))
        return StepResult(loss=loss_v, grad_norm=norm_v, lr=lr, stats=stats)

    def _update(self, step: int, norm: torch.Tensor, outcome: UpdateOutcome = STEPPED) -> None:
        """Clip by ``norm`` on the device and step the optimizer; then the features' hooks."""
        self.engine.apply_update(norm, self.cfg.train.grad_clip)
        self.hooks.after_update(step, outcome)

    def check_nonfinite(self, result: StepResult) -> None:
        """``train.nonfinite = "stop"`` without a per-step read: raise for the run's first
        non-finite loss recorded up to ``result``'s step (reads the step's values: ``fit``
        calls it only at steps it logs, evaluates or checkpoints)."""
        if result.nonfinite is not None:
            self._on_nonfinite(*result.nonfinite)

    def _on_nonfinite(self, step: int, loss: float) -> None:
        """Apply ``train.nonfinite``: stop naming the step and the last good checkpoint, or
        skip the update (at most ``train.max_skipped_steps`` times)."""
        t = self.cfg.train
        self.skipped_nonfinite += 1
        if t.nonfinite == "skip" and self.skipped_nonfinite <= t.max_skipped_steps:
            self.optimizer.zero_grad(set_to_none=False)
            return
        last = checkpoint.latest_checkpoint(self.run_dir)
        where = f"last good checkpoint: {last} (continue with --resume {last})" if last else "no checkpoint was saved yet"
        why = (f"after {self.skipped_nonfinite - 1} skipped steps (train.max_skipped_steps = {t.max_skipped_steps})"
               if t.nonfinite == "skip" else "(train.nonfinite = 'stop'; set it to 'skip' to skip such steps)")
        raise NonFiniteLossError(f"loss is {loss} at step {step} {why}; {where}; try a lower train.lr or train.grad_clip")

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over a fixed validation set of ``eval_batches * global_batch`` sequences."""
        t = self.cfg.train
        per_eval = t.eval_batches * t.global_batch
        loss = self.engine.evaluate(self.micro_batches(1, per_eval, self.val_data)).mean().float()
        self.topo.comm.all_reduce(loss, self.topo.dp_cp, op="avg")
        return float(loss)

    # ------------------------------------------------------------------ loop
    def save_checkpoint(self, step: int) -> Path:
        """Write ``<run_dir>/checkpoints/step-NNNNNN`` atomically (every rank calls this); with
        ``async_checkpoint.enabled`` a thread copies and writes it: the next ``train_step`` holds its
        optimizer update until the copy is done, and the checkpoint is complete once
        ``self.writer.wait()`` returns (or a later poll at a step boundary)."""
        return checkpoint.save(checkpoint.step_dir(self.run_dir, step), self.model, self.optimizer,
                               self.cfg, step, self.topo, self.tokenizer, extra=self._extra_state(),
                               writer=self.writer)

    def _save_checked(self, step: int) -> Path:
        """:meth:`save_checkpoint` in ``fit``: first raise for a non-finite loss the steps since
        the last read left on the device (:meth:`check_nonfinite`), so no NaN weights are saved."""
        if self._latest is not None:
            self.check_nonfinite(self._latest)
        return self.save_checkpoint(step)

    def load_checkpoint(self, path: Path) -> int:
        """Restore model, optimizer and RNG; the data position is the step (global sample ids).
        ``path``: a disk checkpoint, or an in-memory snapshot of this layout (its shard here)."""
        if snapshot.is_snapshot(path):
            extra = self._extra_state()
            step = snapshot.restore(path, self.model, self.optimizer, self.topo.rank, self.topo.world_size,
                                    self.layout_name(), extra)
        else:
            extra = self._extra_state(self.hooks.state_to_load(path))  # what that checkpoint holds
            step = checkpoint.load(path, self.model, self.optimizer, self.cfg, self.topo, extra=extra)
        self.hooks.load_state_dict(extra)
        self.scaler.load_state_dict({k: v.item() for k, v in extra["scaler"].items()})
        self.skipped_nonfinite = int(extra["skipped_nonfinite"])
        return step

    def _extra_state(self, features: dict[str, Any] | None = None) -> dict[str, Any]:
        """Trainer state beyond model and optimizer, as tensors (DCP stores them safely): the
        loss scaler's, and the features' (``features``, default their :meth:`StepHooks.state_dict`)."""
        scaler = {k: torch.tensor(v, dtype=torch.float64) for k, v in self.scaler.state_dict().items()}
        return {"scaler": scaler, "skipped_nonfinite": torch.tensor(self.skipped_nonfinite),
                **(self.hooks.state_dict() if features is None else features)}

    def fit(self, resume: Path | None = None) -> dict[str, Any]:
        """Run steps up to ``train.steps`` with logging, evaluation, checkpoints, plot and sample,
        continuing after checkpoint ``resume`` if given; returns a summary."""
        t = self.cfg.train
        # measured before a resume: the matmul benchmark draws from the RNG the checkpoint restores
        peak, peak_src = devices.peak_flops(self.device, t.precision)
        loading = time.perf_counter()
        start = self._start(resume)
        loaded_s = time.perf_counter() - loading
        log = MetricsLogger(self.run_dir, t.steps, self.is_logger, start_step=start)
        if resume is not None:
            log.write(f"resumed from {resume} at step {start} (loaded in {loaded_s:.2f} s)")
        self.hooks.start_run(start, log)
        log.write(self.describe() + f"\npeak for MFU: {peak / 1e12:.3f} TFLOP/s per rank ({peak_src})")
        losses, traffic = LossRange(first_step=start + 1), LastStepTraffic(self.topo.comm.counter, t.steps)
        evaluation = Evaluation(t.eval_every, t.steps, self.evaluate)
        checkpoints = self._checkpointing()
        meter = ThroughputMeter(self.device, t.global_batch * t.seq_len, self.cfg.model.flops_per_token(t.seq_len),
                                peak, self.topo.world_size)
        with checkpoints.writing(t.timeout_s):  # the end waits for a background save in flight
            for step in range(start + 1, t.steps + 1):
                with traffic.measure(step):  # the summary reports the last step's traffic per axis
                    result = self._latest = self.train_step(step)
                meter.count_step()
                self.hooks.after_step(step, log)
                losses.observe(step, result)  # read only at the end
                evaluating = evaluation.due(step)
                logging = log_due(step, t.log_every, t.steps) or evaluating
                if logging or checkpoints.due(step):
                    self.check_nonfinite(result)  # reads the step's values (its one synchronization)
                if logging:
                    record = step_record(step, result, meter.read(), devices.memory_bytes(self.device),
                                         self.scaler.scale if self.scaler.enabled else None, self.topo.world_size)
                    if evaluating:
                        record["val_loss"] = evaluation.run()
                    log.step(record)
                    meter.restart()  # evaluating and logging are not training time
                else:
                    log.step(None)
                saved = checkpoints.save_if_due(step)
                if saved:
                    meter.restart_clock()  # saving is not training time
                checkpoints.stop_if_requested(step, saved, log)  # raises Preempted
        self.hooks.end_run(log)
        log.close()
        return self._finish(log, losses, evaluation.val_loss, traffic)

    def _checkpointing(self) -> Checkpointing:
        """When ``fit`` saves, how long each save stalled training (``checkpoint_stalls``), the
        background writer's save in flight, and the stop on a signal."""
        t = self.cfg.train
        # the stop agreement runs every step on a gloo side group over a host tensor: it never
        # waits for the device (on the training's own axis, NCCL would need a device read)
        stop_axis = self.topo.side_axis("stop", t.timeout_s) if self.stop is not None else self.topo.world
        checkpoints = Checkpointing(t.checkpoint_every, t.steps, self._save_checked, self.run_dir, self.stop,
                                    stop_axis, torch.device("cpu"), self.writer)
        self.checkpoint_stalls.clear()  # this fit's saves (the list the components were given)
        checkpoints.stalls = self.checkpoint_stalls
        return checkpoints

    def _start(self, resume: Path | None) -> int:
        """Load checkpoint ``resume`` if given and prepare the run directory (rank 0: a fresh
        one, or the metrics cut back to the checkpoint's step); returns the step to continue after."""
        start = 0
        if resume is not None:
            start = self.load_checkpoint(resume)
            if start >= self.cfg.train.steps:
                raise checkpoint.CheckpointError(f"checkpoint {resume} is at step {start} >= train.steps = "
                                                 f"{self.cfg.train.steps}; raise --train.steps to train further")
        if self.is_logger:
            if resume is None:
                self._prepare_run_dir()
            else:
                self._truncate_metrics(start)
        return start

    def _finish(self, log: MetricsLogger, losses: LossRange, val_loss: float,
                traffic: LastStepTraffic) -> dict[str, Any]:
        """The end of a run (collective: pipeline timeline, memory per rank, sample); rank 0
        writes the report and checks the plan (:mod:`hybridpar.training.plancheck`). Returns the
        summary (``summary.json``)."""
        t, m = self.cfg.train, self.cfg.model
        summary = {"first_loss": losses.first, "final_loss": losses.last, "val_loss": val_loss,
                   "steps": t.steps, "layout": self.layout_name(), "params": m.num_params()}
        timeline = self.engine.save_timeline(self.run_dir / "pipeline_timeline.png", self.is_logger)
        memory, differences = self._per_rank(traffic.payload)
        if len(self.data.components) > 1:
            summary["tokens_per_dataset"] = self.data.tokens_drawn(t.steps * t.global_batch, t.seq_len)
        summary["traffic_bytes_per_step"] = traffic.bytes
        summary["peak_memory_bytes_per_rank"] = memory
        summary.update(self.hooks.summary())  # the features' keys
        plan: list[str] = []
        if self.is_logger:
            summary["plan_check"] = check = plancheck.check_run(
                self.cfg, self.device.type, log.history, memory, traffic.payload, differences, self.run_dir,
                self.host_baseline)
            plan = plancheck.lines(check)
        sample = self.sample_text(self.cfg.train.sample_prompt) if self.cfg.train.sample_tokens else None
        report = RunReport(self.run_dir, self.is_logger, self.layout_name(), self.topo.world_size,
                           self.device.type, self.cfg.parallel.pipeline_schedule)
        report.write(log, summary, sample, losses, timeline, plan)
        return summary

    def _per_rank(self, payload: dict[str, int]) -> tuple[list[int], list[int]]:
        """Every rank's peak memory (allocator peak on GPUs, resident set on CPU) and the summed
        difference of its last step's traffic from the planner's (one all-gather; collective)."""
        differs = plancheck.traffic_difference(self.cfg, self.topo.pp.rank, self.topo.dp_cp.rank, payload)
        mine = torch.tensor([devices.memory_bytes(self.device), differs], dtype=torch.float64, device=self.device)
        both = [int(v) for v in self.topo.comm.all_gather(mine, self.topo.world).tolist()]
        return both[0::2], both[1::2]

    def sample_text(self, prompt: str = "def ") -> str:
        """A short continuation of ``prompt`` (every rank calls it; see Engine.sample)."""
        tokens = self.engine.sample(self.tokenizer.encode(prompt), self.cfg.train.sample_tokens, self.cfg.train.seed)
        return self.tokenizer.decode(tokens)

    def layout_name(self) -> str:
        return elastic.layout_name(self.cfg.parallel)

    def describe(self) -> str:
        t, m = self.cfg.train, self.cfg.model
        experts = (f", {m.n_experts} experts top-{m.experts_per_token} in {len(m.moe_layer_ids())} layers"
                   if m.n_experts else "")
        return (f"hybridpar: model {m.preset} ({m.num_params() / 1e6:.2f}M params{experts}), layout {self.layout_name()} "
                f"on {self.topo.world_size} x {self.device.type}, {t.steps} steps x {t.global_batch} seqs x "
                f"{t.seq_len} tokens, micro-batch {t.micro_batch}, {t.precision}")

    def _truncate_metrics(self, step: int) -> None:
        """Drop metrics logged after ``step`` by an interrupted run, so steps never repeat."""
        path = self.run_dir / METRICS_FILE
        if path.exists():
            keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
            atomic_write_text(path, "".join(line + "\n" for line in keep))

    def _prepare_run_dir(self) -> None:
        """Start a fresh run directory; a previous run there is moved to the next numbered
        backup ``<run_dir>.N`` (:func:`hybridpar.training.rundir.backup_previous_run`), never deleted."""
        backup_previous_run(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.run_dir / "config.json", json.dumps(self.cfg.to_dict(), indent=2) + "\n")
