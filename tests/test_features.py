"""The step's seams (:mod:`hybridpar.training.features`): a feature registered on a run sees
each hook in order with the right step numbers, its statistics reach ``metrics.jsonl``, its
summary ``summary.json``, its state the checkpoint and back; the Trainer's loop names no
feature; the registry picks the components a config asks for, in its checked order."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from test_trainer import small_config

from hybridpar.distributed.mesh import ParallelDims
from hybridpar.training import checkpoint
from hybridpar.training.features import (
    COMPONENTS,
    Component,
    Launch,
    StepFeature,
    UpdateOutcome,
    components_for,
)
from hybridpar.training.features.async_checkpoint import AsyncCheckpoint
from hybridpar.training.features.int8 import Int8Compression
from hybridpar.training.features.registry import check_order
from hybridpar.training.metrics import MetricsLogger
from hybridpar.training.trainer import Trainer

FEATURE_NAMES = r"moe|2bw|int8|async|compile|elastic|ahead|upcoming|writer|expert"


class Recorder(StepFeature):
    """Writes down every hook call; adds a statistic, a summary key and a tensor of state."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.counter = torch.zeros(())
        self.loaded: torch.Tensor | None = None

    def start_run(self, start: int, log: MetricsLogger) -> None:
        self.calls.append(("start_run", start))

    def batches(self, step: int) -> list[tuple] | None:
        self.calls.append(("batches", step))
        return None

    def start_step(self, step: int, batches: Any) -> None:
        self.calls.append(("start_step", step))

    def after_backward(self, step: int, microbatches: int) -> dict[str, Any]:
        self.calls.append(("after_backward", step))
        return {"toy_microbatches": microbatches}

    def after_update(self, step: int, outcome: UpdateOutcome) -> None:
        self.calls.append(("after_update", step) if outcome.stepped else ("skipped", step))
        self.counter += outcome.stepped

    def after_step(self, step: int, log: MetricsLogger) -> None:
        self.calls.append(("after_step", step))

    def end_run(self, log: MetricsLogger) -> None:
        self.calls.append(("end_run", None))

    def summary(self) -> dict[str, Any]:
        return {"toy_updates": int(self.counter)}

    def state_dict(self) -> dict[str, Any]:
        return {"toy_counter": self.counter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls.append(("load_state_dict", None))
        self.loaded = state["toy_counter"].clone()


STEP = ["batches", "start_step", "after_backward", "after_update", "after_step"]


def _fit(cfg: Any, resume: Path | None = None) -> tuple[Recorder, dict[str, Any]]:
    with ParallelDims.from_config(cfg.parallel).build("cpu") as topo:
        trainer = Trainer(cfg, topo)
        toy = Recorder()
        trainer.hooks.features.append(toy)  # joins the hooks like a registered component
        summary = trainer.fit(resume)
    return toy, summary


def test_a_feature_sees_every_hook_in_order_and_its_state_round_trips(tmp_path):
    cfg = small_config(tmp_path, "--train.steps", "4", "--train.log_every", "2", "--train.checkpoint_every", "2",
                       "--train.eval_every", "0")
    toy, summary = _fit(cfg)
    assert toy.calls == [("start_run", 0), *[(h, s) for s in range(1, 5) for h in STEP], ("end_run", None)]
    assert summary["toy_updates"] == 4
    run = Path(cfg.train.run_dir)
    assert json.loads((run / "summary.json").read_text())["toy_updates"] == 4
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 4] and all(r["toy_microbatches"] == 4 for r in rows)

    resumed, _ = _fit(cfg, checkpoint.step_dir(run, 2))
    assert resumed.calls[:2] == [("load_state_dict", None), ("start_run", 2)]
    assert resumed.calls[2:] == [*[(h, s) for s in (3, 4) for h in STEP], ("end_run", None)]
    assert resumed.loaded is not None and int(resumed.loaded) == 2  # the checkpoint of step 2 held 2 updates


def test_a_skipped_step_says_so_to_the_update_hook(tmp_path):
    """A step whose update is skipped (non-finite loss, ``train.nonfinite = "skip"``) calls
    ``after_update`` with an outcome that did not step."""
    cfg = small_config(tmp_path, "--train.steps", "2", "--train.nonfinite", "skip")
    with ParallelDims.from_config(cfg.parallel).build("cpu") as topo:
        trainer = Trainer(cfg, topo)
        toy = Recorder()
        trainer.hooks.features.append(toy)
        trainer.engine.loss = lambda *batch: torch.tensor(float("nan"), requires_grad=True)
        result = trainer.train_step(1)
    assert result.skipped
    assert toy.calls == [("batches", 1), ("start_step", 1), ("after_backward", 1), ("skipped", 1)]


def test_the_training_loop_names_no_feature():
    """data -> engine -> hooks -> log / checkpoint: features join through the hooks only."""
    for fn in (Trainer.train_step, Trainer.fit):
        body = inspect.getsource(fn).split('"""')[-1]  # past the docstring
        assert not re.findall(FEATURE_NAMES, body, re.IGNORECASE), fn.__name__


def test_the_registry_follows_the_config(tmp_path):
    plain = small_config(tmp_path)
    int8 = small_config(tmp_path, "--parallel.grad_compression", "int8", "--async_checkpoint.enabled", "true")
    assert list(components_for(plain)) == []
    with ParallelDims.from_config(int8.parallel).build("cpu") as topo:
        trainer = Trainer(int8, topo)
    kinds = [type(f) for f in trainer.hooks]
    staging = trainer.hooks.find(AsyncCheckpoint)
    assert kinds == [Int8Compression, AsyncCheckpoint]
    assert staging is not None and staging.hold_before_backward  # int8's residuals
    assert trainer.writer is staging.writer is not None  # the component owns the background writer


def test_the_registry_order_is_checked():
    """Every component's ``after`` names one registered before it; a wrong order is an error."""
    check_order(COMPONENTS)
    names = [c.name for c in COMPONENTS]
    for kind in COMPONENTS:
        assert all(names.index(before) < names.index(kind.name) for before in kind.after)

    class Late(Component):
        name = "late"
        after = ("compile",)

        @classmethod
        def enabled(cls, cfg: Any, launch: Launch) -> bool:
            return False

    check_order([*COMPONENTS, Late])
    with pytest.raises(ImportError, match=r"'late'.*after 'compile'"):
        check_order([Late, *COMPONENTS])
    with pytest.raises(ImportError, match="no registered component"):
        check_order([Late])
