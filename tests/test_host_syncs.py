"""Device-to-host synchronizations per optimizer step, counted on CPU so CI holds the line
without a GPU: at most one per step, and none on a step that logs nothing in fp32/bf16 (the
loss, gradient norm, non-finite flag and stop request stay on the device until a log step).

What forces a transfer is counted in a ``TorchDispatchMode`` (``aten._local_scalar_dense``,
``is_nonzero``, ``equal``, ``item``, and copies from a non-CPU device to the CPU) and a
``TorchFunctionMode`` (``Tensor.tolist`` / ``numpy``, which read CPU memory without an ATen op).
Reads of host-resident values never wait for a device and are not counted: ``torch.optim``'s
per-parameter ``step`` counters (host tensors unless the optimizer is fused or capturable) and
the stop request's flag, which is agreed on a gloo side group in host memory.
"""

from __future__ import annotations

import contextlib
import gc
import traceback
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_api_engine import CFG as ENGINE_CFG
from test_api_engine import GA, MLP, micro_batch
from test_api_pipeline import HID, M, batch, make_layers
from test_precision import make, nan_at
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import hybridpar
from hybridpar.distributed.lifecycle import StopRequest
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.training.errors import NonFiniteLossError
from hybridpar.training.trainer import Trainer

aten = torch.ops.aten
READS = {aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.item}
COPIES = {aten._to_copy, aten.copy_, aten.to}
HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__}


class Transfers:
    """Counts the reads that would wait for a device, by the step they happen in (``step``)."""

    def __init__(self, host_resident: set[int]) -> None:
        self.host_resident = host_resident  # data_ptr of host tensors whose reads never wait
        self.step = 0
        self.by_step: Counter[int] = Counter()
        self.where: dict[int, list[str]] = {}

    def read(self, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and tensor.data_ptr() in self.host_resident:
            return
        self.by_step[self.step] += 1
        frames = [f for f in traceback.extract_stack() if ("hybridpar" in f.filename or "test_" in f.filename)
                  and f.name not in ("read", "__torch_dispatch__", "__torch_function__")]
        self.where.setdefault(self.step, []).append(" <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}"
                                                                for f in frames[-3:]))


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: Transfers) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket in READS:
            self.counter.read(args[0])
        elif func.overloadpacket in COPIES:
            src = args[1] if func.overloadpacket is aten.copy_ else args[0]
            dst = args[0].device if func.overloadpacket is aten.copy_ else kwargs.get("device")
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst is not None \
                    and torch.device(dst).type == "cpu":
                self.counter.read(src)
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, counter: Transfers) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in HOST_READS:
            self.counter.read(args[0])
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting(host_resident: set[int]) -> Iterator[Transfers]:
    counter = Transfers(host_resident)
    with _Function(counter), _Dispatch(counter):
        yield counter


def host_resident(*extra: torch.Tensor) -> set[int]:
    """The host tensors whose reads do not count: every live torch optimizer's ``step`` counters
    (made by its first step) and ``extra``."""
    ptrs = {t.data_ptr() for t in extra}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.optim.Optimizer):
            for state in obj.state.values():
                step = state.get("step") if isinstance(state, dict) else None
                if isinstance(step, torch.Tensor) and step.device.type == "cpu":
                    ptrs.add(step.data_ptr())
    return ptrs


# ----------------------------------------------------------------------------- the CLI trainer


def _trainer_steps(trainer: Trainer, host: set[int], steps: range) -> list[tuple[int, int, dict]]:
    """Per step: (transfers inside train_step, transfers reading its logged values, where)."""
    out = []
    for step in steps:
        with counting(host) as inside:
            inside.step = step
            result = trainer.train_step(step)
        with counting(host) as logged:
            logged.step = step
            _ = (result.loss, result.grad_norm, result.lr, result.stats, getattr(result, "nonfinite", None))
        out.append((inside.by_step[step], logged.by_step[step], {**inside.where, **logged.where}))
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cli_train_step_reads_nothing_until_logged(tmp_path, precision):
    trainer = make(tmp_path, "--train.precision", precision)
    trainer.train_step(1)  # warm-up: the optimizer makes its state
    for inside, logged, where in _trainer_steps(trainer, host_resident(), range(2, 5)):
        assert inside == 0, where  # a step nobody logs never waits for the device
        assert logged <= 1, where  # its loss, norm and non-finite record come back in one read
    trainer.topo.close()


def test_cli_train_step_fp16_reads_once(tmp_path):
    """fp16 decides skip-or-update on the host: one read per step (overflow flag, loss and norm
    together), and logging the step reads nothing more."""
    trainer = make(tmp_path, "--train.precision", "fp16")
    trainer.train_step(1)
    for inside, logged, where in _trainer_steps(trainer, host_resident(), range(2, 5)):
        assert inside <= 1 and logged == 0, where
    trainer.topo.close()


def _fit_transfers(tmp: str, dp: int) -> tuple[dict[int, int], dict]:
    """Transfers in ``fit`` attributed to the step running (or just finished): 6 steps, logged
    at 1 and 6, with a stop request that is agreed every step (never raised)."""
    trainer = make(__import__("pathlib").Path(tmp), "--train.steps", "6", "--train.log_every", "6",
                   "--train.checkpoint_every", "0", dp=dp)
    trainer.stop = StopRequest()
    real_step = trainer.train_step
    counter = Transfers(set())

    def train_step(step: int) -> Any:
        if step == 2:  # step 1 made the optimizer's state
            flag = getattr(trainer.stop, "host_flag", None)  # a host tensor, where there is one
            counter.host_resident |= host_resident(*([] if flag is None else [flag]))
        counter.step = step
        return real_step(step)

    trainer.train_step = train_step
    with _Function(counter), _Dispatch(counter):
        trainer.fit()
    trainer.topo.close()
    return {s: counter.by_step[s] for s in range(2, 6)}, {s: counter.where.get(s) for s in range(2, 6)}


def test_cli_fit_reads_nothing_on_steps_it_does_not_log(tmp_path):
    counts, where = _fit_transfers(str(tmp_path), 1)
    assert counts == {2: 0, 3: 0, 4: 0, 5: 0}, where


def _fit_worker(rank: int, world: int, tmp: str) -> tuple[dict[int, int], dict]:
    return _fit_transfers(tmp, world)


def test_cli_fit_dp2_reads_nothing_on_steps_it_does_not_log(tmp_path, dist_run):
    results = dist_run(2, _fit_worker, str(tmp_path))
    for counts, where in results:
        assert counts == {2: 0, 3: 0, 4: 0, 5: 0}, where


# ----------------------------------------------------------------------------- initialize() and PipelineModule


def test_initialize_step_reads_nothing():
    """``ModelEngine.step`` keeps the norm on the device; ``last_grad_norm`` reads it once."""
    with ParallelDims().build() as topo:
        torch.manual_seed(0)
        engine = hybridpar.initialize(MLP(), ENGINE_CFG, topo=topo)
        host: set[int] = set()
        for step in range(3):
            for m in range(GA):
                x, y = micro_batch(step, m)
                with counting(host) as c:
                    engine.backward(F.mse_loss(engine(x), y))
                    engine.step()
                assert step == 0 or c.by_step[0] == 0, c.where
            host = host_resident()
            with counting(host) as c:
                assert engine.last_grad_norm is not None and engine.last_grad_norm > 0
            assert c.by_step[0] <= 1, c.where


def test_pipeline_module_step_reads_only_its_loss():
    """``PipelineModule.train_step`` returns the mean loss as a float (its contract): that read
    is the step's one; clipping and the norm stay on the device."""
    with ParallelDims().build() as topo:
        pipe = hybridpar.PipelineModule(layers=make_layers(), topo=topo, num_microbatches=M, loss_fn=F.mse_loss,
                                        activation_shape=(2, HID))
        opt = hybridpar.ZeroOptimizer(list(pipe.named_parameters()), topo.dp, stage=0, lr=1e-2)
        pipe.train_step(list(zip(*(t.chunk(M) for t in batch(0)), strict=True)), opt, max_norm=0.1)
        host = host_resident()
        for step in range(1, 4):
            x, y = batch(step)
            with counting(host) as c:
                loss = pipe.train_step(list(zip(x.chunk(M), y.chunk(M), strict=True)), opt, max_norm=0.1)
            assert isinstance(loss, float) and c.by_step[0] <= 1, c.where


def test_a_nan_loss_unread_at_its_step_stops_at_the_next_log_step(tmp_path):
    """``train.nonfinite = "stop"`` without a per-step read: the NaN of step 2 is kept on the
    device and raised at step 4, the next step ``fit`` logs, naming step 2; nothing was saved."""
    trainer = make(tmp_path, "--train.steps", "6", "--train.log_every", "4", "--train.checkpoint_every", "0")
    nan_at(trainer, {2})
    seen: list[int] = []
    real_step = trainer.train_step

    def train_step(step: int) -> Any:
        seen.append(step)
        return real_step(step)

    trainer.train_step = train_step
    with pytest.raises(NonFiniteLossError, match="loss is nan at step 2 .*no checkpoint was saved yet"):
        trainer.fit()
    assert seen == [1, 2, 3, 4]
    trainer.topo.close()


# ------------------------------------------------------------ host-to-device copies in the forward


class _HostToDevice(TorchDispatchMode):
    """Records every copy of a host tensor to another device. On CUDA such a copy from pageable
    memory (``non_blocking=False``) waits for the GPU (``cudaStreamSynchronize``): the H200
    profile of 2026-11-28 found one per forward, RoPE's frequency table made on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket in COPIES:
            src = args[1] if func.overloadpacket is aten.copy_ else args[0]
            dst = args[0].device if func.overloadpacket is aten.copy_ else kwargs.get("device")
            if isinstance(src, torch.Tensor) and src.device.type == "cpu" and dst is not None \
                    and torch.device(dst).type != "cpu":
                frames = [f for f in traceback.extract_stack() if "hybridpar" in f.filename]
                self.copies.append(" <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in frames[-3:]))
        return func(*args, **kwargs)


ROPES = {"default": {}, "linear": {"rope_type": "linear", "rope_factor": 4.0},
         "llama3": {"rope_type": "llama3", "rope_factor": 8.0, "rope_original_max_len": 16},
         "yarn": {"rope_type": "yarn", "rope_factor": 4.0, "rope_original_max_len": 16}}


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_forward_copies_nothing_from_the_host(rope):
    """The model's forward builds every table on the tokens' device. The model runs on the meta
    device, which stands in for a GPU on CPU: a tensor made on the host and moved shows as a
    cpu -> meta copy."""
    from hybridpar.config import ModelConfig
    from hybridpar.models.registry import family_of

    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=64,
                      **ROPES[rope])
    with torch.device("meta"):
        model = family_of(cfg).build(cfg)
    tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
    with _HostToDevice() as mode:
        logits = model(tokens)
    assert logits.shape == (2, 32, 64) and logits.device.type == "meta"
    assert mode.copies == [], mode.copies
