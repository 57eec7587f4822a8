"""Running any layout in the tests: one config spelling, one trainer construction, one training
worker, one comparison with the single-process reference.

* :func:`make_config`: the small test model's config (:data:`SMALL`) plus flags.
* :func:`trainer_for`: topology, then Trainer (a context manager: the topology closes after);
  :func:`make_trainer` for a trainer that outlives the block (its topology is never closed).
* :class:`Run`: what to train (flags, steps, a checkpoint to resume from or save at, probes);
  :func:`train_layout` trains it on the reused worker pool (``harness.run_distributed``) and
  returns each rank's :class:`Trained`; :func:`reference` trains it in this process, once.
* :func:`assert_trains_like`: every rank's losses and rank 0's gathered weights against the
  reference, by the tolerance rule of :mod:`numerics` (``LOSS_RTOL``, ``layout_weight_atol``).

Only public API (``load_config``, ``ParallelDims``, ``Trainer``, ``train_step``,
``save_checkpoint`` / ``load_checkpoint``, ``engine.full_state_dict``) is used here; anything
deeper a test needs goes in its own ``before`` / ``after`` probe.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from harness import run_distributed
from numerics import LOSS_RTOL, adam_noise_cap, weight_outliers

from hybridpar.config import Config, ModelConfig, load_config
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.training import checkpoint
from hybridpar.training.trainer import Trainer

# The small model and run of the tests: a few ms per step, every parallel axis divides it.
SMALL = [
    "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
    "--model.ffn_hidden", "64", "--model.max_seq_len", "64",
    "--train.seq_len", "32", "--train.global_batch", "8", "--train.micro_batch", "2",
    "--train.warmup_steps", "2", "--train.eval_batches", "1", "--train.sample_tokens", "16",
]
LR = 3e-3  # the layout tests' learning rate (high enough that a layout bug shows within STEPS)
STEPS = 3

Probe = Callable[[Trainer], dict[str, Any]]


def make_config(run_dir: str, *flags: str, base: Sequence[str] = tuple(SMALL), lr: float | None = LR,
                init_model: Callable[[str], ModelConfig] | None = None) -> Config:
    """``base`` flags, the learning rate (none with ``lr=None``), the run directory, then ``flags``
    (model, layout and feature flags, in the command line's ``--section.key value`` spelling)."""
    rate = [] if lr is None else ["--train.lr", str(lr)]
    return load_config(None, [*base, *rate, "--train.run_dir", run_dir, *flags], init_model=init_model)


@contextlib.contextmanager
def trainer_for(cfg: Config, **kwargs: Any) -> Iterator[Trainer]:
    """A Trainer of ``cfg`` on its own topology (collective when the layout has several ranks);
    the topology's groups are destroyed when the block ends. ``kwargs`` go to ``Trainer``."""
    with ParallelDims.from_config(cfg.parallel).build("cpu") as topo:
        yield Trainer(cfg, topo, **kwargs)


def make_trainer(cfg: Config, **kwargs: Any) -> Trainer:
    """A Trainer of ``cfg`` on a topology left open (for tests that keep the trainer around)."""
    return Trainer(cfg, ParallelDims.from_config(cfg.parallel).build("cpu"), **kwargs)


@dataclass(frozen=True)
class Run:
    """One training run of a test: its config (as :func:`make_config`), the last step to train,
    a checkpoint step to resume from (``resume_from``) and one to save at (``save_at``), and
    probes called with the trainer before the first and after the last step, whose dicts land
    in :attr:`Trained.extra`. Hashable, so :func:`reference` caches by it; picklable, so the
    probes must be module-level functions."""

    run_dir: str
    flags: tuple[str, ...] = ()
    steps: int = STEPS
    base: tuple[str, ...] = tuple(SMALL)
    lr: float | None = LR
    init_model: Callable[[str], ModelConfig] | None = None
    resume_from: int = 0
    save_at: int = 0
    before: Probe | None = None
    after: Probe | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "flags", tuple(self.flags))
        object.__setattr__(self, "base", tuple(self.base))

    def config(self) -> Config:
        return make_config(self.run_dir, *self.flags, base=self.base, lr=self.lr, init_model=self.init_model)

    @property
    def world_size(self) -> int:
        return self.config().parallel.world_size


@dataclass
class Trained:
    """One rank's outcome of a :class:`Run`: the step it started after (the resumed checkpoint's,
    else 0), per-step losses, skipped flags, loss scales after each step and MoE statistics,
    the gathered weights (rank 0 only; None elsewhere) and the probes' results."""

    start: int
    losses: list[float]
    skipped: list[bool]
    scales: list[float]
    moe: list[dict[str, Any] | None]
    state: dict[str, torch.Tensor] | None
    extra: dict[str, Any] = field(default_factory=dict)
    noise_cap: float = 0.0  # numerics.adam_noise_cap of the run's peak lr and last step


def train(rank: int, world: int, run: Run) -> Trained:
    """Train ``run`` on this rank (the worker :func:`train_layout` sends to every rank)."""
    with trainer_for(run.config()) as trainer:
        start = trainer.load_checkpoint(checkpoint.step_dir(trainer.run_dir, run.resume_from)) \
            if run.resume_from else 0
        extra = run.before(trainer) if run.before else {}
        results, scales = [], []
        for step in range(start + 1, run.steps + 1):
            results.append(trainer.train_step(step))
            scales.append(trainer.scaler.scale)
            if step == run.save_at:
                trainer.save_checkpoint(step)
        if trainer.writer is not None:  # async_checkpoint.enabled: a save is complete once written
            trainer.writer.wait()
        state = trainer.engine.full_state_dict()  # collective (ZeRO-3, pp)
        if run.after:
            extra.update(run.after(trainer))
        return Trained(start, [r.loss for r in results], [r.skipped for r in results], scales,
                       [r.moe for r in results], state if rank == 0 else None, extra,
                       adam_noise_cap(trainer.cfg.train.lr, run.steps))


def train_layout(run: Run, *, here_if_one: bool = False, timeout: float = 120) -> list[Trained]:
    """Each rank's :class:`Trained` of ``run``, trained on the reused gloo worker pool of its
    world size (or, with ``here_if_one`` and a world of one, in this process)."""
    world = run.world_size
    if world == 1 and here_if_one:
        return [train(0, 1, run)]
    return run_distributed(world, train, run, timeout=timeout)


def train_one_thread(run: Run) -> Trained:
    """``run`` trained in this process on one intra-op thread, as the workers run (tiny ops on
    busy shared cores: several times faster than torch's default thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(0, 1, run)
    finally:
        torch.set_num_threads(threads)


@functools.cache
def reference(run: Run) -> Trained:
    """``run`` trained in this process (one rank), once per session."""
    return train(0, 1, run)


def assert_trains_like(results: Sequence[Trained], expected: Trained, *, atol: float | None,
                       rel: float = LOSS_RTOL, same_keys: bool = False, first: tuple[str, ...] = ()) -> None:
    """Every rank's losses equal ``expected``'s from the step it started after, to ``rel``
    relative; with ``atol``, rank 0's gathered weights equal ``expected``'s to that absolute
    tolerance (keys ending in ``first`` checked first; ``same_keys``: the same tensors too)."""
    for rank, r in enumerate(results):
        assert r.losses == pytest.approx(expected.losses[r.start - expected.start:], rel=rel), f"rank {rank}"
    if atol is None:
        return
    state = results[0].state
    assert state is not None
    if same_keys:
        assert state.keys() == expected.state.keys()
    for k in sorted(state, key=lambda k: not k.endswith(first)) if first else state:
        assert_weights_close(k, state[k], expected.state[k], atol, expected.noise_cap)


def assert_weights_close(name: str, actual: torch.Tensor, expected: torch.Tensor, atol: float, cap: float) -> None:
    """``actual`` equals ``expected`` to ``atol``, except for at most
    :func:`numerics.weight_outliers` entries (noise-gradient entries Adam moves by up to lr a
    step), which must stay within ``cap`` (:func:`numerics.adam_noise_cap`; 0: no exceptions)."""
    diff = (actual.detach().double() - expected.detach().double()).abs()
    over = int((diff > atol).sum())
    if cap > atol and over <= weight_outliers(expected.numel()) and float(diff.max()) <= cap:
        return
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")
