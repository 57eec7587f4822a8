"""The compute measurements behind ``hybridpar calibrate``: GEMM rate by shape, causal
attention, element-wise bandwidth, the fixed cost of a small op and of one eager Llama block.

Two choices make them repeatable on a shared machine, and both matter for the step times the
planner predicts from them (``benchmarks/planner_time.py``):

* **Cold operands.** A training step streams its activations and weights: each GEMM or
  element-wise op reads tensors last touched a layer ago. Operands are therefore taken in turn
  from one pool several times the last-level cache (:func:`cold_pool`); a tensor reused back to
  back stays in cache and overstates the rate (10-41% for this runtime's GEMMs on a 2-core
  EPYC, several times for element-wise ops).
* **Interleaved passes.** Every probe is first sized to batches of about ``min_time_s``; then
  ``passes`` passes each time one batch of every probe, and each probe keeps its median batch
  (:func:`time_interleaved`). A slow spell of the machine (seconds long on a shared VM) then
  costs every probe one sample, instead of costing the few probes timed during it all of
  theirs; timed one after another, single probes varied by 20-60% between calibrations here.
  The median batch (a mean per call, robust to a burst) is the right estimator for a step,
  which is the sum of many such calls: the fastest batch would understate the wake-ups, cache
  misses and dispatch jitter that recur every step.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridpar.config import ModelConfig
from hybridpar.distributed import device as devices
from hybridpar.models.llama.model import Block, precompute_rope

Probe = Callable[[], object]


@dataclass(frozen=True)
class Plan:
    """What to measure: grids of shapes and message sizes, and how long to time each."""

    gemm_dims: tuple[int, ...]  # every dimension of the GEMM grid takes these values
    attention_seqs: tuple[int, ...]
    head_dims: tuple[int, ...]
    message_bytes: tuple[int, ...]
    min_time_s: float  # per timing batch
    batches: int  # timing batches (interleaved passes) per point; the median batch is kept

    @classmethod
    def for_device(cls, device: str, quick: bool) -> Plan:
        if device == "cuda":
            dims = (256, 1024, 4096, 16384) if quick else (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
            return cls(dims, (512, 2048) if quick else (512, 1024, 2048, 4096, 8192), (64, 128),
                       (1 << 16, 1 << 20, 1 << 24, 1 << 27), 0.01 if quick else 0.05, 3 if quick else 5)
        dims = (32, 128, 512, 2048) if quick else (32, 64, 128, 256, 512, 1024, 2048)
        return cls(dims, (64, 256) if quick else (64, 128, 256, 512, 1024), (16, 64) if quick else (16, 32, 64, 128),
                   (1 << 12, 1 << 16, 1 << 20, 1 << 23), 0.01 if quick else 0.02, 5 if quick else 7)


def reps_for(fn: Probe, device: torch.device, min_time_s: float) -> int:
    """Calls of ``fn`` (after one warm-up call) that make a batch of about ``min_time_s``."""
    fn()
    devices.synchronize(device)
    t0 = time.perf_counter()
    fn()
    devices.synchronize(device)
    return max(1, min(10_000, int(min_time_s / max(time.perf_counter() - t0, 1e-7))))


def batch_time(fn: Probe, device: torch.device, reps: int) -> float:
    """Seconds per call over one batch of ``reps`` calls."""
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    devices.synchronize(device)
    return (time.perf_counter() - t0) / reps


def median_per_call(fn: Probe, device: torch.device, reps: int, batches: int,
                    before_batch: Probe = lambda: None) -> float:
    """Median over ``batches`` consecutive batches of ``reps`` calls of the seconds per call."""
    per_call = []
    for _ in range(batches):
        before_batch()
        per_call.append(batch_time(fn, device, reps))
    return statistics.median(per_call)


def time_interleaved(probes: dict[str, Probe], device: torch.device, min_time_s: float,
                     passes: int) -> dict[str, float]:
    """Seconds per call of every probe, from ``passes`` interleaved passes (module doc)."""
    reps = {name: reps_for(fn, device, min_time_s) for name, fn in probes.items()}
    samples: dict[str, list[float]] = {name: [] for name in probes}
    for _ in range(passes):
        for name, fn in probes.items():
            samples[name].append(batch_time(fn, device, reps[name]))
    return {name: statistics.median(s) for name, s in samples.items()}


def cold_pool(device: torch.device, dtype: torch.dtype, min_numel: int = 0) -> torch.Tensor:
    """One random buffer several times the last-level cache (CPU 64 MB, GPU 256 MB), or of
    ``min_numel`` elements if more (so that every probe's operands are views of it)."""
    nbytes = (64 if device.type == "cpu" else 256) << 20
    return torch.randn(max(min_numel, nbytes * 8 // torch.finfo(dtype).bits), device=device, dtype=dtype)


def pool_views(pool: torch.Tensor, *shapes: tuple[int, ...]) -> list[tuple[torch.Tensor, ...]]:
    """Disjoint groups of tensors of ``shapes`` carved from ``pool`` (at least two groups: fresh
    tensors when one group would not fit twice), to be used in turn."""
    sizes = [math.prod(s) for s in shapes]
    count = pool.numel() // sum(sizes)
    if count < 2:
        return [tuple(torch.randn(s, device=pool.device, dtype=pool.dtype) for s in shapes) for _ in range(2)]
    groups, offset = [], 0
    for _ in range(min(count, 64)):
        group = []
        for shape, size in zip(shapes, sizes, strict=True):
            group.append(pool[offset:offset + size].view(shape))
            offset += size
        groups.append(tuple(group))
    return groups


def in_turn(groups: list[tuple[torch.Tensor, ...]], op: Callable[..., torch.Tensor]) -> Probe:
    """A probe that applies ``op`` to the next group of ``groups`` at each call."""
    turn = [0]

    def probe() -> torch.Tensor:
        turn[0] = (turn[0] + 1) % len(groups)
        return op(*groups[turn[0]])

    return probe


def attention_batch_heads(seq: int, head_dim: int, device: torch.device) -> int:
    """Batch x heads of one attention probe: ~10 ms of a CPU core, ~0.1 ms of a GPU."""
    target = 2e8 if device.type == "cpu" else 5e10
    return int(max(1, min(1024, target // (2 * seq * seq * head_dim))))


def attention_probes(seq: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> tuple[Probe, Probe]:
    """(forward, forward + backward) of causal SDPA at ``(seq, head_dim)``."""
    bh = attention_batch_heads(seq, head_dim, device)
    q, k, v = (torch.randn(1, bh, seq, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, bh, seq, head_dim, device=device, dtype=dtype)

    def fwd() -> torch.Tensor:
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd() -> object:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out, (q, k, v), grad)

    return fwd, fwd_bwd


def block_probes(device: torch.device, dtype: torch.dtype) -> tuple[Probe, Probe]:
    """(forward, forward + backward) of one :class:`hybridpar.models.llama.Block` at a tiny
    shape (4 tokens of width 16): the fixed eager cost of a layer (dispatch, autograd, module
    calls), which byte and FLOP counts miss."""
    shape = ModelConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32, vocab_size=16, max_seq_len=4)
    block = Block(shape).to(device=device, dtype=dtype)
    x = torch.randn(1, 4, 16, device=device, dtype=dtype, requires_grad=True)
    cos, sin = precompute_rope(8, torch.arange(4, device=device), 1e4)

    def forward() -> torch.Tensor:
        return block(x, cos, sin)

    def both() -> None:
        y = block(x, cos, sin)
        y.backward(torch.ones_like(y))

    return forward, both


@dataclass
class ComputeRates:
    """What :func:`measure_compute` found: the tables and constants of a profile."""

    gemm: list[list[float]]  # [m, n, k, FLOP/s]
    attention: list[list[float]]  # [seq, head_dim, forward FLOP/s, backward FLOP/s]
    elementwise_bw: float  # bytes/s read plus written by a streamed out-of-place product
    small_op_s: float  # seconds of one eager op on 8 elements that records autograd history
    block_s: tuple[float, float]  # (forward, backward) fixed seconds of one eager block


def measure_compute(plan: Plan, device: torch.device, dtype: torch.dtype) -> ComputeRates:
    """Every compute probe, timed in interleaved passes (module doc).

    GEMM ``[m, k] @ [k, n]`` on the full grid; attention forward and forward + backward (the
    backward's FLOPs are 2.5x the forward's, as FlashAttention-2 counts); the bandwidth of
    ``a * b`` (read 2, write 1) on 1 MB (CPU) / 128 MB (GPU) tensors; the small op; the block."""
    dims = plan.gemm_dims
    # two groups of the largest GEMM's operands fit: all probes exist at once, as views of one pool
    pool = cold_pool(device, dtype, 4 * max(dims) ** 2)
    probes: dict[str, Probe] = {}
    for m in dims:
        for n in dims:
            for k in dims:
                probes[f"gemm {m} {n} {k}"] = in_turn(pool_views(pool, (m, k), (k, n)), torch.mm)
    for s in plan.attention_seqs:
        for d in plan.head_dims:
            probes[f"attn {s} {d}"], probes[f"attn+bwd {s} {d}"] = attention_probes(s, d, device, dtype)
    numel = 1 << 18 if device.type == "cpu" else 1 << 26
    probes["stream"] = in_turn(pool_views(pool, (numel,), (numel,)), torch.mul)
    x = torch.ones(8, device=device, dtype=dtype, requires_grad=True)
    probes["small op"] = lambda: x * x
    probes["block"], probes["block+bwd"] = block_probes(device, dtype)
    t = time_interleaved(probes, device, plan.min_time_s, plan.batches)

    gemm = [[m, n, k, 2.0 * m * n * k / t[f"gemm {m} {n} {k}"]] for m in dims for n in dims for k in dims]
    attention = []
    for s in plan.attention_seqs:
        for d in plan.head_dims:
            flops = 4.0 * attention_batch_heads(s, d, device) * s * s * d / 2
            t_f, t_fb = t[f"attn {s} {d}"], t[f"attn+bwd {s} {d}"]
            attention.append([s, d, flops / t_f, 2.5 * flops / max(t_fb - t_f, 1e-3 * t_f)])
    bw = 3 * numel * pool.element_size() / t["stream"]
    return ComputeRates(gemm, attention, bw, t["small op"], (t["block"], max(t["block+bwd"] - t["block"], 0.0)))
