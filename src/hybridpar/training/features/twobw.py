"""PipeDream-2BW in the step (``parallel.pipeline_schedule = "2bw"``,
:mod:`hybridpar.parallel.pipeline.twobw`): the read-ahead and the second weight version.

Step s starts batch s+1's warm-up forwards, so the feature reads batch s+1 during step s, hands
it to the runner (:meth:`~hybridpar.parallel.pipeline.twobw.TwoBWRunner.read_ahead`) and gives
the same micro-batches to step s+1. A checkpoint keeps the stale weight version beside the
model's (the newest) under ``weight_versions``, placed as the model's weights (tp pieces as
DTensors) so another layout can read it; a checkpoint of a synchronous schedule has none, and
2BW starts from it afresh (both versions the loaded weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor

from hybridpar.config import Config
from hybridpar.parallel.pipeline.twobw import TwoBWRunner
from hybridpar.training import checkpoint
from hybridpar.training.features.component import Component, Launch, RunContext

__all__ = ["TwoBWComponent"]

STATE_KEY = "weight_versions"


class TwoBWComponent(Component):
    """The 2BW runner of a run of ``train.steps`` steps (module doc); the engine builds the
    runner for the schedule, :meth:`attach` takes it and the run's batch reader."""

    name = "2bw"
    backward_writes_checkpoint_state = True  # the pipeline's cut rewrites the older weight version

    @classmethod
    def enabled(cls, cfg: Config, launch: Launch) -> bool:
        return cfg.parallel.pipeline_schedule == "2bw" and cfg.parallel.pp > 1

    def __init__(self, cfg: Config, launch: Launch) -> None:
        super().__init__(cfg, launch)
        self.last_step = cfg.train.steps
        self._ahead: tuple[int, list[tuple]] | None = None  # the next step's micro-batches, read early

    def attach(self, run: RunContext) -> None:
        assert isinstance(run.engine.runner, TwoBWRunner)  # the engine's runner for "2bw"
        self.engine, self.runner, self.read = run.engine, run.engine.runner, run.read

    def batches(self, step: int) -> list[tuple] | None:
        return self._ahead[1] if self._ahead is not None and self._ahead[0] == step else None

    def start_step(self, step: int, batches: Sequence[tuple]) -> None:
        """Read the next step's batch (none after the last step) for the runner to start."""
        upcoming = None
        if step < self.last_step:
            upcoming = self.read(step + 1)
            self._ahead = (step + 1, upcoming)
        self.runner.read_ahead(upcoming)

    def state_dict(self) -> dict[str, Any]:
        """The stale weight version (the one the next step's batch runs on) by parameter name,
        placed as a checkpoint places the model's weights."""
        placed = self.engine.optimizer.checkpoint_state(self.engine.model)["model"]  # the newest, as saved
        out: dict[str, Tensor] = {}
        for name, t in zip(self.runner.versions.names, self.runner.versions.stale, strict=True):
            ref = placed[name]
            out[name] = (DTensor.from_local(t, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape,
                                            stride=ref.stride()) if isinstance(ref, DTensor) else t)
        return {STATE_KEY: out} if out else {}

    def state_to_load(self, path: Path) -> dict[str, Any]:
        """None from a synchronous schedule's checkpoint: 2BW starts afresh from it."""
        if checkpoint.read_config(path).parallel.pipeline_schedule != "2bw":
            return {}
        return self.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The stale version from the checkpoint, or (a synchronous schedule's) equal to the
        loaded weights, as at a start."""
        versions = self.runner.versions
        loaded: dict[str, Tensor] | None = state.get(STATE_KEY)
        if loaded is None:
            loaded = dict(zip(versions.names, versions.newest, strict=True))
        versions.load_stale({n: t.to_local() if isinstance(t, DTensor) else t for n, t in loaded.items()})
