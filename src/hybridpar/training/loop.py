"""The pieces ``Trainer.fit`` calls once per step, one concern each.

* :class:`ThroughputMeter`: tokens/s, MFU and step time over the steps since the last logged one;
* :class:`Evaluation`: when validation runs (``train.eval_every``) and its latest loss;
* :class:`Checkpointing`: when a checkpoint is saved (``train.checkpoint_every``, the last step),
  how long training waited for each, the save in flight (``async_checkpoint.enabled``) and the stop
  on a signal every rank agreed to (:class:`~hybridpar.distributed.lifecycle.Preempted`);
* :class:`LastStepTraffic`: the wire bytes per axis of the run's last step;
* :class:`LossRange`: the first and the last loss of this run (or of this resumed part);
* :class:`RunReport`: the end-of-run files and lines on rank 0 (``summary.json``,
  ``sample.txt``, the loss plot, the final log lines).

:func:`log_due` says which steps ``metrics.jsonl`` records, :func:`step_record` what it records
for one (the keys are a public contract: ``step world loss lr grad_norm tokens_per_s mfu mem_bytes
step_time_s`` and, when they apply, ``skipped loss_scale val_loss``; MoE models add ``aux_loss
expert_load_imbalance expert_imbalance_per_layer dropped_tokens expert_load``).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import Tensor

from hybridpar.distributed import device as devices
from hybridpar.distributed.comm import CommCounter
from hybridpar.distributed.lifecycle import Preempted, StopRequest, signal_name
from hybridpar.distributed.mesh import Axis
from hybridpar.training import checkpoint
from hybridpar.training.checkpoint import BackgroundWriter
from hybridpar.training.features.base import DeviceStats
from hybridpar.training.metrics import METRICS_FILE, MetricsLogger, atomic_write_text


class StepResult:
    """What one optimizer step returns (``Trainer.train_step``).

    ``loss`` and ``grad_norm`` may be given as device tensors: they stay on the device until
    first read, and are then read to the host together, in one transfer (:meth:`resolve`), so
    a step nobody logs never waits for its device. ``nonfinite``: ``[step, loss]`` of the first
    step of the run whose loss was NaN/Inf (step 0: none yet), kept on the device likewise
    (``train.nonfinite = "stop"`` without a per-step read: ``Trainer.fit`` checks it whenever
    it reads a step's values). ``stats``: a dict, or the features' :class:`DeviceStats`, read
    in the same transfer."""

    def __init__(self, loss: float | Tensor, grad_norm: float | Tensor, lr: float, skipped: bool = False,
                 stats: dict[str, Any] | DeviceStats | None = None,
                 nonfinite: Tensor | None = None) -> None:
        self.lr = lr
        self.skipped = skipped  # no optimizer update: fp16 overflow or a skipped non-finite loss
        self._stats = stats
        parts = [loss, grad_norm] + ([] if nonfinite is None else list(nonfinite.unbind()))
        self._device: Tensor | None = None
        self._host: list[float] | None = None
        if any(isinstance(v, Tensor) for v in parts):
            like = next(v for v in parts if isinstance(v, Tensor))
            self._device = torch.stack([v.detach().reshape(()).to(torch.float64) if isinstance(v, Tensor)
                                        else torch.full((), v, dtype=torch.float64, device=like.device)
                                        for v in parts])  # a fill, not a host-to-device copy
        else:
            self._host = [float(v) for v in parts]

    def resolve(self) -> None:
        """Read the step's values and its features' device statistics to the host, in one
        transfer (once; later calls are free)."""
        stats = self._stats.tensors if isinstance(self._stats, DeviceStats) else ()
        pending = ([] if self._device is None else [self._device]) + list(stats)
        if not pending:
            return
        flat = [t.detach().reshape(-1).to(torch.float64) for t in pending]
        values = torch.cat([t.to(flat[0].device) for t in flat]).tolist()  # the one device-to-host read
        lists, at = [], 0
        for t in flat:
            lists.append(values[at:at + t.numel()])
            at += t.numel()
        if self._device is not None:
            self._host, self._device = lists.pop(0), None
        if isinstance(self._stats, DeviceStats):
            self._stats = self._stats.make(lists)

    @property
    def loss(self) -> float:
        return self._values()[0]

    @property
    def grad_norm(self) -> float:
        return self._values()[1]

    @property
    def nonfinite(self) -> tuple[int, float] | None:
        """``(step, loss)`` of the run's first non-finite loss up to this step, if any."""
        values = self._values()
        if len(values) < 4 or values[2] == 0:
            return None
        return int(values[2]), values[3]

    def _values(self) -> list[float]:
        self.resolve()
        return self._host or []

    @property
    def stats(self) -> dict[str, Any] | None:
        """The step's statistics from the features (StepFeature.after_backward), added to its
        record; made on first read when a feature kept them on the device."""
        self.resolve()
        return self._stats  # type: ignore[return-value]

    @property
    def moe(self) -> dict[str, Any] | None:
        """MoE models: the step's expert statistics (the features' statistics; None for a dense
        model), by the name scripts used before the step had features."""
        return self.stats


@dataclass(frozen=True)
class Throughput:
    """Rates over a window of steps (what :meth:`ThroughputMeter.read` returns)."""

    tokens_per_s: float
    #: model FLOPs utilisation: achieved FLOP/s over the peak of every rank together; None (null in
    #: ``metrics.jsonl``, "n/a" on the progress bar) when it would exceed 1: the peak was then a
    #: measured rate (CPU, unknown GPU) that the machine has since beaten, so the true MFU is unknown
    mfu: float | None
    step_time_s: float


class ThroughputMeter:
    """Times a window of steps: the steps since the last :meth:`restart`, on the host clock
    read after the device has finished its queued work."""

    def __init__(self, device: torch.device, tokens_per_step: int, flops_per_token: float,
                 peak_flops: float, world_size: int) -> None:
        self.device = device
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops  # per rank
        self.world_size = world_size
        self.restart()

    def restart(self) -> None:
        """Open a new window with no steps in it."""
        self._t0, self._steps = time.perf_counter(), 0

    def restart_clock(self) -> None:
        """Keep the window's steps but not the time so far (e.g. a checkpoint save is not
        training time)."""
        self._t0 = time.perf_counter()

    def count_step(self) -> None:
        self._steps += 1

    def read(self) -> Throughput:
        """Synchronize the device, then the window's tokens/s, MFU and mean step time."""
        devices.synchronize(self.device)
        elapsed = time.perf_counter() - self._t0
        tps = self.tokens_per_step * self._steps / elapsed
        mfu = self.flops_per_token * tps / (self.peak_flops * self.world_size)
        return Throughput(tokens_per_s=tps, mfu=mfu if mfu <= 1.0 else None, step_time_s=elapsed / self._steps)


def log_due(step: int, log_every: int, last_step: int) -> bool:
    """``metrics.jsonl`` records step 1, every ``train.log_every``-th step and the last one
    (and, besides, every step that evaluates)."""
    return step == 1 or step % log_every == 0 or step == last_step


def step_record(step: int, result: StepResult, rate: Throughput, mem_bytes: int,
                loss_scale: float | None, world: int = 1) -> dict[str, Any]:
    """One line of ``metrics.jsonl`` (``val_loss`` is added by the caller when it evaluates);
    the key order is the file's. ``world``: the processes that trained the step (an elastic
    job's changes between restarts)."""
    record: dict[str, Any] = {
        "step": step, "world": world, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
        "tokens_per_s": rate.tokens_per_s, "mfu": rate.mfu, "mem_bytes": mem_bytes, "step_time_s": rate.step_time_s,
    }
    if result.skipped:
        record["skipped"] = True
    if loss_scale is not None:  # fp16 only
        record["loss_scale"] = loss_scale
    if result.stats is not None:  # the features' (MoE models: expert statistics)
        record.update(result.stats)
    return record


class Evaluation:
    """Validation every ``every`` steps and at the last step (never when ``every`` is 0)."""

    def __init__(self, every: int, last_step: int, evaluate: Callable[[], float]) -> None:
        self.every, self.last_step = every, last_step
        self._evaluate = evaluate  # collective: every rank calls it at the same step
        self.val_loss = float("nan")  # the latest result; NaN before the first

    def due(self, step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == self.last_step)

    def run(self) -> float:
        self.val_loss = self._evaluate()
        return self.val_loss


class Checkpointing:
    """Saves every ``every`` steps and at the last step; stops the run early when a signal asked
    for it and every rank agreed (:meth:`StopRequest.agreed`, collective over ``world``).

    With a ``writer`` (``async_checkpoint.enabled``) ``save`` only stages the state and the
    writer's thread writes it: each step boundary polls it (its failure is raised there), and
    the end of training (:meth:`writing`) and a stop on a signal wait for the save in flight.
    ``stalls``: ``(step, seconds)`` training waited for each save: the save itself, or (in the
    background) its start and any wait for its copy of the state (:meth:`BackgroundWriter.hold`)."""

    def __init__(self, every: int, last_step: int, save: Callable[[int], Path], run_dir: Path,
                 stop: StopRequest | None, world: Axis, device: torch.device,
                 writer: BackgroundWriter | None = None) -> None:
        self.every, self.last_step = every, last_step
        self._save = save  # collective: every rank writes its shard
        self.run_dir = run_dir
        self.stop, self.world, self.device = stop, world, device
        self.writer = writer
        self.stalls: list[tuple[int, float]] = []
        self._started_s = 0.0  # how long starting the last background save took

    def due(self, step: int) -> bool:
        return step == self.last_step or (self.every > 0 and step % self.every == 0)

    def save_if_due(self, step: int) -> bool:
        """Save step ``step`` if it is due; returns whether it was saved. Ends a background save
        that every rank has finished (raising its failure)."""
        start = time.perf_counter()
        if self.writer is not None:
            self._count_hold()
            self.writer.poll()
        if not self.due(step):
            return False
        self._save(step)
        self._started_s = time.perf_counter() - start
        self.stalls.append((step, self._started_s))
        return True

    def _count_hold(self) -> None:
        """Add the training's wait for the last background save's copy to its stall."""
        if self.writer is not None and self.stalls:
            self.stalls[-1] = (self.stalls[-1][0], self._started_s + self.writer.held_s)

    @contextlib.contextmanager
    def writing(self, timeout_s: float) -> Iterator[None]:
        """Wrap the training loop: at its end wait for the background save in flight (raising
        its failure); if the loop fails, give that save up to ``timeout_s`` to finish."""
        try:
            yield
        except BaseException:
            if self.writer is not None:
                self.writer.abandon(timeout_s)
            raise
        if self.writer is not None:
            self.writer.wait()
            self._count_hold()

    def stop_if_requested(self, step: int, saved: bool, log: MetricsLogger) -> None:
        """Before the last step, ask every rank whether a signal arrived; if so, make sure step
        ``step`` is checkpointed, say so, close ``log`` and raise :class:`Preempted`."""
        if step < self.last_step and self.stop is not None and (signum := self.stop.agreed(self.world, self.device)):
            self._preempt(step, saved, signum, log)

    def _preempt(self, step: int, saved: bool, signum: int, log: MetricsLogger) -> NoReturn:
        path = checkpoint.step_dir(self.run_dir, step) if saved else self._save(step)
        if self.writer is not None:
            self.writer.wait()  # the checkpoint is complete before the job says so and exits
        log.write(f"stopping after step {step}: {signal_name(signum)} received; checkpoint {path}")
        log.close()
        raise Preempted(signum, step, path)


class LastStepTraffic:
    """Measures the bytes this rank sends per axis (ring model) during the run's last step, and
    the payload bytes per axis (what :func:`hybridpar.planner.price.traffic.comm_bytes_per_axis`
    predicts: the run's plan check)."""

    def __init__(self, counter: CommCounter, last_step: int) -> None:
        self.counter, self.last_step = counter, last_step
        self.bytes: dict[str, int] = {}  # {axis: bytes}, axes that sent nothing left out
        self.payload: dict[str, int] = {}  # {axis: payload bytes}, axes that moved nothing left out

    @contextlib.contextmanager
    def measure(self, step: int) -> Iterator[None]:
        """Wrap step ``step``; only the last step is measured."""
        if step != self.last_step:
            yield
            return
        before, payload = self.counter.wire_bytes_by_axis(), self._payload()
        yield
        self.bytes = self.counter.wire_bytes_since(before)
        self.payload = {a: b - payload.get(a, 0) for a, b in self._payload().items() if b > payload.get(a, 0)}

    def _payload(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for key, row in self.counter.snapshot().items():  # "op/axis"
            axis = key.split("/", 1)[1]
            out[axis] = out.get(axis, 0) + row["bytes"]
        return out


class LossRange:
    """The loss of the first step this call of ``fit`` trained, and of the latest one (their
    :class:`StepResult`, read only when asked: no per-step device synchronization)."""

    def __init__(self, first_step: int) -> None:
        self.first_step = first_step
        self._first: StepResult | None = None
        self._last: StepResult | None = None

    def observe(self, step: int, result: StepResult) -> None:
        if step == self.first_step:
            self._first = result
        self._last = result

    @property
    def first(self) -> float:
        return float("nan") if self._first is None else self._first.loss

    @property
    def last(self) -> float:
        return float("nan") if self._last is None else self._last.loss


def _size(nbytes: int) -> str:
    """``1.57 MiB``, or ``12.0 KiB`` below a hundredth of a MiB (which would print as 0.00 MiB)."""
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 / 100 else f"{nbytes / 2**10:.1f} KiB"


class RunReport:
    """The end of a run as rank 0 reports it: ``summary.json``, ``sample.txt``, the loss plot and
    the final log lines. Other ranks get a report that writes nothing."""

    def __init__(self, run_dir: Path, enabled: bool, layout: str, world_size: int, device_type: str,
                 pipeline_schedule: str) -> None:
        self.run_dir, self.enabled = run_dir, enabled
        self.layout, self.world_size = layout, world_size
        self.device_type, self.pipeline_schedule = device_type, pipeline_schedule

    def write(self, log: MetricsLogger, summary: dict[str, Any], sample: str | None, losses: LossRange,
              timeline: tuple[Path, float] | None, plan: Sequence[str] = ()) -> None:
        """Write the files and lines (``log`` is closed; it still draws the plot and prints);
        ``plan``: the plan check's lines, printed after the traffic and memory."""
        if not self.enabled:
            return
        plot = log.plot()
        if losses.first_step > 1:  # a resumed segment: the run's first loss is step 1's, in metrics.jsonl
            summary.update(first_loss=self.run_first_loss(losses.first), segment_first_step=losses.first_step,
                           segment_first_loss=losses.first)
        if sample is not None:
            atomic_write_text(self.run_dir / "sample.txt", sample)
        atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        if sample is not None:  # train.sample_tokens = 0: no sample, no empty block
            log.write(f"--- sample ---\n{sample}\n--------------")
        log.write(self.details(summary["traffic_bytes_per_step"], summary["peak_memory_bytes_per_rank"], timeline))
        for line in plan:
            log.write(line)
        if "expert_imbalance" in summary:
            per_layer = " ".join(f"{v:.2f}" for v in summary["expert_imbalance_per_layer"])
            log.write(f"experts: load max/mean {summary['expert_imbalance']:.2f} (worst layer, mean over steps); "
                      f"per layer {per_layer}; dropped tokens {summary['dropped_tokens']}")
        val_loss = summary["val_loss"]
        val = f"validation {val_loss:.4f}" if val_loss == val_loss else "no validation (train.eval_every = 0)"
        log.write(f"loss {losses.first:.4f} (step {losses.first_step}) -> {losses.last:.4f} "
                  f"(step {summary['steps']}), {val}; run dir {self.run_dir} (metrics.jsonl, {plot and plot.name}, "
                  f"tensorboard/, {'sample.txt, ' if sample is not None else ''}summary.json)")

    def run_first_loss(self, fallback: float) -> float:
        """Step 1's loss as ``metrics.jsonl`` recorded it (every run logs step 1), else ``fallback``."""
        path = self.run_dir / METRICS_FILE
        lines = path.read_text().splitlines() if path.exists() else []
        first = next((json.loads(x) for x in lines if x.strip()), None)
        return float(first["loss"]) if first is not None and first.get("step") == 1 else fallback

    def details(self, traffic: dict[str, int], memory: list[int], timeline: tuple[Path, float] | None) -> str:
        """The end-of-run lines: layout, traffic per axis, memory per rank, pipeline bubble."""
        mib = 2**20
        lines = [f"layout: {self.layout} on {self.world_size} process(es)"]
        moved = {axis: b for axis, b in traffic.items() if b}  # an axis that sent nothing (HSDP's whole dp) is no news
        if moved:
            lines.append("traffic per step (rank 0, ring-model bytes sent): "
                         + ", ".join(f"{axis} {_size(b)}" for axis, b in moved.items()))
        what = "GPU allocator peak" if self.device_type == "cuda" else "peak resident set"
        lines.append(f"memory per rank ({what}): " + " ".join(f"r{r} {b / mib:.0f}" for r, b in enumerate(memory))
                     + " MiB")
        if timeline is not None:
            path, bubble = timeline
            lines.append(f"pipeline: {self.pipeline_schedule}, last step's bubble {bubble:.1%}; timeline {path}")
        return "\n".join(lines)
