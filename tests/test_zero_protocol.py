"""The data-parallel optimizer interface and the library's process-wide side effects.

Every optimizer the step engine drives (ZeRO stages 0-3, the expert split, a plain torch
optimizer) implements :class:`hybridpar.parallel.zero.DataParallelOptimizer`, so
:class:`hybridpar.training.step.StepEngine` asks none of them what it is; and the library API
(``hybridpar.initialize``, ``PipelineModule``) leaves glibc's malloc alone unless asked
(``hybridpar.keep_host_heap()``), while the CLI trainer sets it in its CPU workers.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hybridpar.distributed.mesh import ParallelDims, Topology
from hybridpar.parallel.tensor_plan import TensorPlan
from hybridpar.parallel.zero import (
    DataParallelOptimizer,
    ErrorFeedback,
    ExpertSplitOptimizer,
    LocalOptimizer,
    ZeroOptimizer,
    decay_groups,
    shard_model,
)
from hybridpar.training.step import StepEngine

MEMBERS = sorted(n for n, _ in inspect.getmembers(DataParallelOptimizer) if not n.startswith("_"))
FEEDBACK = sorted(n for n, _ in inspect.getmembers(ErrorFeedback) if not n.startswith("_"))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _step(topo: Topology, opt: DataParallelOptimizer, model: nn.Module, rank: int) -> float:
    """One step through the StepEngine; returns the gradient norm it computed."""
    engine = StepEngine(topo, opt, TensorPlan.of_names({}), list(model.named_parameters()),
                        loss=lambda x: model(x).square().mean())
    opt.zero_grad()
    gen = torch.Generator().manual_seed(rank)
    engine.forward_backward([(torch.randn(4, 8, generator=gen),), (torch.randn(4, 8, generator=gen),)])
    return float(engine.update(1.0))


def _kinds_worker(rank: int, world: int) -> dict[str, tuple[bool, list[str], bool, float, int | None, list[str]]]:
    out: dict[str, tuple[DataParallelOptimizer, nn.Module]] = {}
    with ParallelDims(dp=world).build("cpu") as topo:
        for stage in (0, 1, 2, 3):
            model = _model()
            sharded = shard_model(model, topo.dp, [model[0], model[2]]) if stage == 3 else None
            out[f"zero{stage}"] = ZeroOptimizer(decay_groups(model, 0.1), topo.dp, stage=stage, sharded=sharded,
                                                lr=1e-2), model
        model = _model()
        dense, experts = list(model[0].named_parameters(prefix="0")), list(model[2].named_parameters(prefix="2"))
        out["expert-split"] = ExpertSplitOptimizer(ZeroOptimizer(dense, topo.dp, stage=1, lr=1e-2),
                                                   ZeroOptimizer(experts, topo.dp, stage=2, lr=1e-2), topo.ep), model
        model = _model()
        out["local"] = LocalOptimizer(torch.optim.SGD(model.parameters(), lr=1e-2), list(model.named_parameters())), model
        result = {}
        for name, (opt, model) in out.items():
            missing = [m for m in MEMBERS if not hasattr(type(opt), m)]
            feedback = [m for m in FEEDBACK if hasattr(type(opt), m)]  # int8's part: ZeRO's, not a plain one's
            norm = _step(topo, opt, model, rank)
            mode = opt.mode if isinstance(opt, ZeroOptimizer) else None  # the stage family actually run
            result[name] = (isinstance(opt, DataParallelOptimizer), missing, opt.reduces_per_stage, norm, mode, feedback)
        return result


def test_every_optimizer_kind_implements_the_protocol(dist_run):
    """ZeRO 0-3, the expert split and a plain optimizer: each has every member of the interface
    and steps through the StepEngine (whose norm is the same on every dp rank)."""
    assert {"finish_grads", "norm_parts", "gather_full_state_dict", "reduces_per_stage", "checkpoint_state"} <= set(MEMBERS)
    assert FEEDBACK == ["reset_residuals", "residuals", "scale_residuals"] and not set(FEEDBACK) & set(MEMBERS)
    ranks = dist_run(2, _kinds_worker)
    for name, (is_dp, missing, per_stage, norm, _, feedback) in ranks[0].items():
        assert is_dp and missing == [] and per_stage is False, name
        assert norm > 0 and torch.isfinite(torch.tensor(norm)), name
        assert feedback == ([] if name == "local" else FEEDBACK), name  # a plain optimizer implements less
    assert [ranks[0][f"zero{s}"][4] for s in range(4)] == [0, 1, 2, 3]  # replicated, sharded 1/2, parameter-sharded
    for name in ("zero0", "zero1", "zero2", "zero3", "expert-split"):  # reduced: every rank's norm is one
        assert ranks[0][name][3] == pytest.approx(ranks[1][name][3], rel=1e-6), name


def test_step_engine_asks_no_optimizer_what_it_is():
    """What differs between the optimizers is the interface's business, not the step's."""
    source = inspect.getsource(StepEngine)
    for word in ("isinstance", "hasattr", "getattr", "zero is None", "zero is not None"):
        assert word not in source, word


_PROBE = """
import torch
from torch import nn
import hybridpar
from hybridpar.distributed import device

engine = hybridpar.initialize(nn.Linear(4, 4), {"lr": 0.1})
engine.backward(engine(torch.randn(2, 4)).square().mean())
engine.step()
topo = hybridpar.ParallelDims().build("cpu")
pipe = hybridpar.PipelineModule(layers=[nn.Linear(4, 4)], topo=topo, num_microbatches=2,
                                loss_fn=lambda out, y: (out - y).square().mean(), activation_shape=(2, 4))
pipe.train_step((torch.randn(4, 4), torch.randn(4, 4)), torch.optim.SGD(pipe.parameters(), lr=0.1))
print(device._host_heap_kept)  # None: keep_host_heap was never called
print(hybridpar.keep_host_heap() == device._host_heap_kept and device._host_heap_kept is not None)
"""


def test_library_api_leaves_malloc_alone_unless_asked():
    """``initialize`` and ``PipelineModule`` train without touching malloc's settings; the
    documented opt-in, ``hybridpar.keep_host_heap()``, then sets them (once per process)."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"})
    assert out.stdout.split() == ["None", "True"], out.stdout + out.stderr


def test_cli_worker_keeps_the_host_heap(monkeypatch, tmp_path):
    """The CLI trainer's worker makes the choice the library no longer makes for it."""
    from hybridpar.cli import main
    from hybridpar.distributed import device as devices

    calls = []
    monkeypatch.setattr(devices, "keep_host_heap", lambda: calls.append(1) or True)
    args = ["--model.dim", "32", "--model.n_layers", "1", "--model.n_heads", "4", "--model.n_kv_heads", "2",
            "--model.ffn_hidden", "64", "--model.max_seq_len", "32", "--train.seq_len", "16",
            "--train.global_batch", "2", "--train.micro_batch", "2", "--train.eval_every", "0",
            "--train.sample_tokens", "0", "--train.steps", "1", "--train.run_dir", str(tmp_path / "r")]
    assert main(["train", *args]) == 0
    assert calls == [1]
