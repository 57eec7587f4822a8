"""How fast each class of kernel runs on a device: the efficiency model the cost model times
a step with (:mod:`hybridpar.planner.price.cost`).

One matmul efficiency for everything was 5-10% optimistic on small models and long contexts
(issue 34): small GEMMs, attention and memory-bound kernels each run at their own fraction of
the data sheet. Four kernel classes, each with its source:

* **GEMM** ``[m, k] @ [k, n]``: ``2mnk / (peak * gemm * q(m) q(n) q(k) * s(m) s(n) s(k))``, at
  least its bytes over the achieved memory bandwidth, plus a device-side ``launch`` (ramp and
  tail). ``gemm`` is the large-GEMM fraction of the dense peak sustained through training (cuBLAS
  bf16: ~0.8 on A100, NVIDIA "Matrix Multiplication Background User's Guide"; ~0.75 on H100 SXM,
  700-780 of 989 TFLOP/s on training shapes at the 700 W power cap; a short burst measured 0.82 on
  an H100 with ``hybridpar calibrate --device cuda``, docs/explanation/planner-validation.md section 8). ``q`` is tile
  quantisation (128-wide tiles). ``s(x) = x / (x + knee)`` is the small-dimension fall-off: the
  guide's sweeps (A100, fp16, its figures of throughput against one dimension with the others
  large) reach half the large-shape rate near 128 in m or n (too few output tiles to fill the
  SMs) and near 64 in k (each tile's prologue and epilogue amortised over fewer k steps), ~90%
  past 1024; ``s(x) = x / (x + knee)`` for m and n, ``k / (k + knee / 2)``, ``knee = 128``.
* **Attention** (fused causal SDPA, FlashAttention-2 in torch): its own FLOPs at
  ``attention * peak``, falling for short sequences as ``s / (s + attention_knee)``, never
  faster than reading q, k, v and writing o (the memory-bound floor); backward runs at
  ``attention_bwd`` of the forward rate. FlashAttention-2 reaches ~72% of A100 peak forward and
  ~60% backward at long sequences, about half that below 1k tokens (Dao 2023, figures 4-5); on
  H100 the same kernel reaches 335-350 TFLOP/s forward, ~35% of peak (Shah et al. 2024,
  "FlashAttention-3", figure 5: FlashAttention-2 on H100 SXM5, head dim 128); smaller heads are
  slower (``head_knee``).
* **Memory-bound** (norms, RoPE, activations, residual adds, the loss's softmax, optimizer,
  and the per-parameter passes the planner used to miss: autocast's weight casts and gradient
  accumulation, :func:`hybridpar.planner.price.rates.weight_traffic`, and gradient clipping,
  :func:`hybridpar.planner.price.rates.clip_time`):
  bytes over ``memory * hbm_bw``; streaming kernels reach ~90% of HBM bandwidth (STREAM-like
  copies: 3.0 of 3.35 TB/s measured by ``hybridpar calibrate`` on H100; ~1.8 of 2.0 TB/s on
  A100 80GB, NVIDIA's "A100 Tensor Core GPU Architecture" whitepaper).
* **Host launch floor**: eager PyTorch issues each kernel from Python; when a layer's kernels are
  shorter than their dispatch the GPU waits for the host. A layer's time is at least its kernel
  count times ``host`` seconds (PyTorch eager dispatch + autograd: ~10 us per op on a modern
  x86 host, PyTorch "Performance Tuning Guide" / profiler traces; torch.compile's generated
  wrappers ~4 us per kernel).

A measured profile (``hybridpar calibrate``, :class:`hybridpar.planner.machine.hardware.Calibration`)
replaces the GEMM and attention formulas with its tables. :class:`Efficiency` ``.fit`` holds
multipliers of each class's time fitted to a training run (``hybridpar plan --from-run``,
:mod:`hybridpar.planner.front.fit`); 1.0 for data-sheet devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hybridpar.planner.errors import PlanError
from hybridpar.planner.machine.memo import IdentityMemo

if TYPE_CHECKING:
    from hybridpar.planner.machine.hardware import GPUSpec

TILE = 128  # GEMM tile edge used for quantisation (cuBLAS/CUTLASS bf16 tiles are 128-256 wide)
CLASSES = ("gemm", "attention", "memory", "launch")  # the kernel classes a fit scales


@dataclass(frozen=True)
class Efficiency:
    """Fractions of a device's data sheet each kernel class reaches (see the module doc), and
    ``fit``: fitted multipliers of each class's time (:data:`CLASSES` order)."""

    gemm: float = 0.8
    gemm_knee: float = 128.0
    attention: float = 0.72
    attention_bwd: float = 0.83  # backward rate / forward rate (FA-2: ~60% vs ~72% of peak on A100)
    attention_knee: float = 512.0
    head_knee: float = 0.0  # head dim at which attention's rate would halve (0: no head-dim effect)
    memory: float = 0.9
    launch: float = 4e-6  # device-side per kernel: ramp, tail, the gap between kernels
    host: float = 10e-6  # host-side dispatch per eager kernel
    host_compiled: float = 4e-6  # per kernel under torch.compile (generated wrapper, no autograd per op)
    fit: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)

    def scaled(self, **factors: float) -> Efficiency:
        """This efficiency with its fitted multipliers multiplied by ``factors`` (class: x)."""
        fit = tuple(f * factors.get(c, 1.0) for c, f in zip(CLASSES, self.fit, strict=True))
        return replace(self, fit=fit)  # type: ignore[arg-type]


# Per device family (matched on the GPUSpec's name): A100 and H100/H200 from the sources in the
# module doc; B200 from NVIDIA's Blackwell data sheet ratio (no published sweep yet: H100's shape).
DEFAULTS: dict[str, Efficiency] = {
    "A100": Efficiency(gemm=0.8, attention=0.72, attention_bwd=0.83, memory=0.9, head_knee=24.0),
    "H100": Efficiency(gemm=0.75, attention=0.35, attention_bwd=0.85, memory=0.9, head_knee=24.0),
    "H200": Efficiency(gemm=0.75, attention=0.35, attention_bwd=0.85, memory=0.9, head_knee=24.0),
    "B200": Efficiency(gemm=0.7, attention=0.35, attention_bwd=0.85, memory=0.9, head_knee=24.0),
}


def efficiency_of(gpu: GPUSpec) -> Efficiency:
    """The device's :class:`Efficiency`: its own (a profile's ``[efficiency]`` table), else the
    family default by name, else the planner's earlier single-efficiency model built from its
    ``gemm_efficiency`` and ``launch_overhead`` (custom and calibrated devices: a calibrated CPU's
    tables already hold what it reaches; attention at 0.7 of peak, FlashAttention-2 on A100).
    Memoised per device (the search asks for it millions of times)."""
    return _EFFICIENCIES.get(gpu, None, lambda: _efficiency_of(gpu))


_EFFICIENCIES: IdentityMemo[Efficiency] = IdentityMemo(256)


def _efficiency_of(gpu: GPUSpec) -> Efficiency:
    if gpu.efficiency is not None:
        return gpu.efficiency
    for family, eff in DEFAULTS.items():
        if gpu.name.upper().startswith(family):
            return replace(eff, launch=gpu.launch_overhead)
    return Efficiency(gemm=gpu.gemm_efficiency, gemm_knee=0.0, attention=0.7, attention_bwd=1.0, attention_knee=0.0,
                      memory=1.0, launch=gpu.launch_overhead, host=0.0, host_compiled=0.0)


def _q(x: float) -> float:
    return x / (math.ceil(x / TILE) * TILE)


def shape_factor(m: float, n: float, k: float, knee: float) -> float:
    """Tile quantisation times the small-dimension fall-off of a ``[m, k] @ [k, n]`` GEMM."""
    return _q(m) * _q(n) * _q(k) * (m / (m + knee)) * (n / (n + knee)) * (k / (k + knee / 2))


def gemm_device_time(m: float, n: float, k: float, peak: float, gpu: GPUSpec, ab: int) -> float:
    """Seconds of one GEMM on the data-sheet model (module doc), fitted multipliers applied."""
    e = efficiency_of(gpu)
    flops = 2.0 * m * n * k / (peak * e.gemm * shape_factor(m, n, k, e.gemm_knee))
    mem = ab * (m * k + k * n + m * n) / (gpu.hbm_bw * e.memory)
    return max(flops, mem) * e.fit[0] + e.launch * e.fit[3]


def attention_time(flops: float, seq: float, head_dim: float, io_bytes: float, peak: float,
                   gpu: GPUSpec) -> tuple[float, float]:
    """(forward, backward) seconds of fused causal attention doing ``flops`` forward (2.5x that
    backward) at sequence length ``seq`` and ``head_dim``, moving ``io_bytes`` (q, k, v, o)
    forward. ``attention`` is the rate at head dim 128; smaller heads do less work per tile
    loaded (FlashAttention-3 paper, figure 5: FlashAttention-2 at head dim 64 runs ~0.85x its
    head-dim-128 rate): ``d / (d + head_knee)`` relative to 128."""
    e = efficiency_of(gpu)
    heads = (head_dim / (head_dim + e.head_knee)) / (128 / (128 + e.head_knee))
    rate = peak * e.attention * heads * seq / (seq + e.attention_knee)
    floor = io_bytes / (gpu.hbm_bw * e.memory)
    fwd = max(flops / rate, floor) * e.fit[1]
    bwd = max(2.5 * flops / (rate * e.attention_bwd), 2 * floor) * e.fit[1]
    return fwd, bwd


def scale_attention(times: tuple[float, float], gpu: GPUSpec) -> tuple[float, float]:
    """Measured attention times with the fitted attention multiplier applied."""
    f = efficiency_of(gpu).fit[1]
    return times[0] * f, times[1] * f


def memory_time(nbytes: float, gpu: GPUSpec) -> float:
    """Seconds of memory-bound kernels moving ``nbytes`` (read + written)."""
    e = efficiency_of(gpu)
    return nbytes / (gpu.hbm_bw * e.memory) * e.fit[2]


def fixed_time(seconds: float, gpu: GPUSpec) -> float:
    """A fixed per-kernel cost (launches, a measured block's fixed cost), fitted multiplier applied."""
    return seconds * efficiency_of(gpu).fit[3]


def host_floor(kernels: float, gpu: GPUSpec, compiled: bool) -> float:
    """The least seconds the host needs to issue ``kernels`` kernels (module doc); 0 for devices
    without a host (a calibrated CPU's measured block cost already holds its dispatch)."""
    e = efficiency_of(gpu)
    return kernels * (e.host_compiled if compiled else e.host) * e.fit[3]


def to_table(e: Efficiency) -> dict[str, object]:
    """The ``[efficiency]`` table of a profile (plain numbers; :func:`from_table` reads it)."""
    return {"gemm": e.gemm, "gemm_knee": e.gemm_knee, "attention": e.attention, "attention_bwd": e.attention_bwd,
            "attention_knee": e.attention_knee, "head_knee": e.head_knee, "memory": e.memory, "launch": e.launch, "host": e.host,
            "host_compiled": e.host_compiled, "fit": list(e.fit)}


def from_table(data: dict[str, object], where: str, base: Efficiency | None = None) -> Efficiency:
    """An :class:`Efficiency` from a profile's ``[efficiency]`` table, checked key by key; keys
    it leaves out keep ``base``'s values (the device's family default)."""
    known = set(to_table(Efficiency()))
    unknown = sorted(set(data) - known)
    if unknown:
        raise PlanError(f"{where}: unknown [efficiency] keys {unknown}; known: {sorted(known)}")
    values: dict[str, object] = {}
    for key, value in data.items():
        if key == "fit":
            ok = (isinstance(value, list) and len(value) == len(CLASSES)
                  and all(isinstance(x, int | float) and not isinstance(x, bool) and x > 0 for x in value))
            if not ok:
                raise PlanError(f"{where}: efficiency.fit must be {len(CLASSES)} positive numbers ({', '.join(CLASSES)})")
            values["fit"] = tuple(float(x) for x in value)  # type: ignore[union-attr]
        elif isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise PlanError(f"{where}: efficiency.{key} = {value!r} must be a non-negative number")
        else:
            values[key] = float(value)
    return replace(base or Efficiency(), **values)  # type: ignore[arg-type]
