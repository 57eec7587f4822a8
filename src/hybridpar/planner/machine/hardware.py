"""Accelerator specs and cluster shape: the physical constants the planner's models divide by.

Every number carries its public source. Bandwidths are bytes/s *per GPU, per direction*:
``intra_bw`` is the GPU's NVLink/NVSwitch bandwidth inside a node, ``inter_bw`` the network
bandwidth of the NIC(s) attached to one GPU (DGX/HGX systems have one NIC per GPU). Peaks are
dense (no 2:4 sparsity). Two efficiencies are device constants, not per-layout fudge factors:
``gemm_efficiency`` (the fraction of peak a large, well-shaped cuBLAS GEMM reaches) and
``comm_efficiency`` (NCCL bus bandwidth over link bandwidth); ``hybridpar calibrate`` is meant to
measure them. Custom devices load from TOML (:func:`load_gpu_toml`).

A profile written by ``hybridpar calibrate`` is such a TOML file with a ``[calibration]`` table as
well: measured GEMM rates on a grid of shapes, causal-attention rates, and ``alpha + beta * bytes``
fits per collective and axis size (:class:`Calibration`). Where it has data the cost model uses
the measurement instead of peak x efficiency or the ring formula with link bandwidth.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridpar.planner.errors import PlanError
from hybridpar.planner.machine.efficiency import Efficiency, efficiency_of, from_table

GB = 1e9
GiB = 2**30


# Payload-bytes multiplier of a ring collective over n ranks (the comm counter's payload: the whole
# tensor for all-reduce and send, the local shard for all-gather, the full input for
# reduce-scatter), used to carry a fit measured at one axis size to another.
_RING_BYTES = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
               "all_gather": lambda n: float(n - 1), "send": lambda n: 1.0}
_RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "reduce_scatter": lambda n: n - 1,
               "all_gather": lambda n: n - 1, "send": lambda n: 1}
COMM_OPS = tuple(_RING_BYTES)


@dataclass(frozen=True)
class CommFit:
    """Measured seconds of ``op`` on an axis of ``size`` ranks: ``alpha + beta * payload bytes``
    (payload as the comm counter records it)."""

    op: str
    size: int
    alpha: float  # s, the latency of one call
    beta: float  # s per payload byte


def _axis_interp(axis: tuple[float, ...], x: float) -> tuple[int, int, float]:
    """Bracketing indices and weight of ``x`` on a sorted grid axis, in log space, clamped."""
    if len(axis) == 1 or x <= axis[0]:
        return 0, 0, 0.0
    if x >= axis[-1]:
        return len(axis) - 1, len(axis) - 1, 0.0
    j = bisect.bisect_right(axis, x)
    i = j - 1
    return i, j, (math.log(x) - math.log(axis[i])) / (math.log(axis[j]) - math.log(axis[i]))


def _grid_rate(axes: tuple[tuple[float, ...], ...], table: dict[tuple[float, ...], float],
               point: tuple[float, ...]) -> float:
    """Multilinear interpolation of ``log(rate)`` on a full grid, log-spaced coordinates.

    Inside the grid: interpolation. Beyond the largest point: the edge rate (big shapes
    saturate). Below the smallest point of an axis: the rate falls in proportion to the size
    (a call that small costs what the smallest measured call costs: overhead-bound)."""
    brackets = [_axis_interp(a, x) for a, x in zip(axes, point, strict=True)]
    log_rate = 0.0
    for corner in range(2 ** len(axes)):
        w, key = 1.0, []
        for d, (i, j, f) in enumerate(brackets):
            hi = corner >> d & 1
            w *= f if hi else 1.0 - f
            key.append(axes[d][j if hi else i])
        if w:
            log_rate += w * math.log(table[tuple(key)])
    rate = math.exp(log_rate)
    for a, x in zip(axes, point, strict=True):
        if x < a[0]:
            rate *= x / a[0]
    return rate


def _grid(rows: tuple[tuple[float, ...], ...], dims: int, what: str) -> tuple[tuple[tuple[float, ...], ...],
                                                                            dict[tuple[float, ...], float]]:
    """The axes and ``point -> rate`` map of a table whose rows are ``(*point, rate)`` on a full grid."""
    axes = tuple(tuple(sorted({r[d] for r in rows})) for d in range(dims))
    table = {tuple(r[:dims]): r[dims] for r in rows}
    if len(table) != math.prod(len(a) for a in axes) or any(r[dims] <= 0 for r in rows):
        raise PlanError(f"calibration.{what} must hold a positive rate for every point of a full grid "
                        f"({' x '.join(str(len(a)) for a in axes)} points), got {len(table)} rows")
    return axes, table


@dataclass(frozen=True)
class Calibration:
    """What ``hybridpar calibrate`` measured on one device (``dtype`` matmuls, ``threads`` CPU
    threads per process) and backend.

    ``gemm``: ``(m, n, k, FLOP/s)`` of ``[m, k] @ [k, n]`` on a full grid of shapes (one call,
    overheads included). ``attention``: ``(seq, head_dim, forward FLOP/s, backward FLOP/s)`` of
    causal scaled-dot-product attention, counting ``4 * seq^2 * head_dim / 2`` forward and 2.5x
    that backward per head. ``comm``: one :class:`CommFit` per (op, axis size) measured.
    ``block``: (forward, backward) seconds of this runtime's Llama block at a tiny shape, the
    fixed eager cost of one layer (kernel dispatch, autograd, module calls) that no byte or FLOP
    count sees. ``concurrency``: ``(ranks busy, GEMM rate, element-wise rate)`` as fractions of
    the one-busy-rank rates, for devices that share a chip (CPU cores share caches, memory
    bandwidth and sometimes a physical core). ``overlap``: the fraction of an asynchronous
    collective that compute on the same rank hides (1 on GPUs, whose copies and reductions run
    beside the kernels; less on CPUs, where the backend's thread competes for the cores)."""

    device: str = "cpu"
    dtype: str = "fp32"
    backend: str = "gloo"
    threads: int = 1
    gemm: tuple[tuple[float, float, float, float], ...] = ()
    attention: tuple[tuple[float, float, float, float], ...] = ()
    comm: tuple[CommFit, ...] = ()
    block: tuple[float, float] | None = None
    concurrency: tuple[tuple[float, float, float], ...] = ()
    overlap: float | None = None
    _grids: dict[str, Any] = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.gemm:
            self._grids["gemm"] = _grid(self.gemm, 3, "gemm")
        if self.attention:
            self._grids["fwd"] = _grid(tuple((s, d, f) for s, d, f, _ in self.attention), 2, "attention")
            self._grids["bwd"] = _grid(tuple((s, d, b) for s, d, _, b in self.attention), 2, "attention")

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    def gemm_rate(self, m: float, n: float, k: float) -> float | None:
        """Measured FLOP/s of an ``[m, k] @ [k, n]`` GEMM (interpolated), None without a table."""
        if not self.gemm:
            return None
        return _grid_rate(*self._grids["gemm"], (m, n, k))

    def attention_rates(self, seq: float, head_dim: float) -> tuple[float, float] | None:
        """Measured (forward, backward) FLOP/s of causal attention, None without a table."""
        if not self.attention:
            return None
        point = (seq, head_dim)
        return _grid_rate(*self._grids["fwd"], point), _grid_rate(*self._grids["bwd"], point)

    def slowdown(self, busy: int) -> tuple[float, float]:
        """(GEMM, element-wise) rate fractions with ``busy`` ranks computing at once on one
        node: the measurement at that count, else at the nearest measured count below it
        (1.0 without measurements)."""
        rows = sorted(self.concurrency)
        below = [r for r in rows if r[0] <= busy]
        if not below:
            return 1.0, 1.0
        return below[-1][1], below[-1][2]

    def comm_time(self, op: str, nbytes: float, size: int) -> float | None:
        """Seconds of ``op`` with ``nbytes`` payload over ``size`` ranks from the fit at that
        size, or carried from the nearest measured size by the ring's step and byte counts;
        None if ``op`` was not measured."""
        if size <= 1:
            return 0.0
        fits = [f for f in self.comm if f.op == op]
        if not fits:
            return None
        fit = min(fits, key=lambda f: (abs(math.log(f.size / size)), -f.size))
        steps, per_byte = _RING_STEPS[op], _RING_BYTES[op]
        alpha = fit.alpha * steps(size) / steps(fit.size)
        beta = fit.beta * per_byte(size) / per_byte(fit.size)
        return alpha + beta * nbytes


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator. Rates in FLOP/s, sizes in bytes, bandwidths in bytes/s, latencies in s."""

    name: str
    bf16_flops: float  # dense bf16/fp16 tensor-core peak
    fp32_flops: float  # plain (non-tensor-core) fp32 peak
    hbm_bytes: float  # device memory capacity
    hbm_bw: float  # device memory bandwidth
    intra_bw: float  # NVLink per GPU, per direction
    inter_bw: float  # network per GPU, per direction
    intra_latency: float = 5e-6  # per collective step inside a node
    inter_latency: float = 10e-6  # per collective step across nodes
    gemm_efficiency: float = 0.8  # large-GEMM fraction of peak
    comm_efficiency: float = 0.8  # achieved NCCL bus bandwidth / link bandwidth
    launch_overhead: float = 4e-6  # per kernel (launch + tail), s
    host_bw: float = 25 * GB  # host link for offload: PCIe Gen4 x16 is 32 GB/s raw, ~25 achieved
    # Host memory and NVMe per GPU, for offload: DGX A100 / H100 / B200 carry 1 / 2 / 4 TB of
    # system memory for 8 GPUs (128 / 256 / 512 GB each; DGX datasheets) and 8 NVMe drives of
    # ~3.5 GB/s read (8x 3.84 TB U.2 on DGX H100), about one drive per GPU.
    host_bytes: float = 128 * GB
    disk_bw: float = 3.5 * GB
    calibration: Calibration | None = None  # measured tables (hybridpar calibrate)
    # per-kernel-class efficiencies (hybridpar.planner.machine.efficiency; None: the family default), as
    # a profile's [efficiency] table writes them (hybridpar calibrate --from-run fits them)
    efficiency: Efficiency | None = None
    fp8_flops: float = 0.0  # dense FP8 tensor-core peak (fp8.recipe; planner/price/fp8.py); 0 = none
    # device memory a plan leaves free: the CUDA context, NCCL's buffers and the caching
    # allocator's fragmentation live outside what the memory model counts (the GPUs below: 5%)
    headroom_bytes: float = 0.0

    @property
    def usable_bytes(self) -> float:
        """Device memory a layout may plan to fill: ``hbm_bytes - headroom_bytes``."""
        return self.hbm_bytes - self.headroom_bytes


# Latency: NCCL's per-hop base latency is a few microseconds on NVLink and about ten across
# InfiniBand (NCCL tuning model, src/graph/tuning.cc baseLat/hwLat tables). GEMM efficiency:
# cuBLAS bf16 GEMMs reach ~250-270 of 312 TFLOP/s on A100 and ~700-780 of 989 on H100
# (NVIDIA "Matrix Multiplication Background User's Guide" and MLPerf-era cuBLAS benchmarks), about 0.8
# and 0.75. Communication efficiency: nccl-tests all-reduce bus bandwidth on DGX A100 is ~230 GB/s
# over 300 GB/s NVLink and ~190 GB/s over 8x25 GB/s HDR (NVIDIA DGX A100 user guide, nccl-tests).
GPUS: dict[str, GPUSpec] = {
    # NVIDIA A100 Tensor Core GPU datasheet (2021): BF16 312 TFLOPS dense, FP32 19.5 TFLOPS,
    # 40 GB HBM2 at 1,555 GB/s, NVLink 600 GB/s (bidirectional). DGX A100 datasheet: 8x
    # ConnectX-6 200 Gb/s HDR InfiniBand, one per GPU = 25 GB/s.
    "A100-40GB": GPUSpec("A100-40GB", 312e12, 19.5e12, 40 * GiB, 1555 * GB, 300 * GB, 25 * GB,
                         gemm_efficiency=0.8),
    # Same datasheet, 80 GB HBM2e at 2,039 GB/s; Selene (Narayanan et al. 2021, section 5) is
    # DGX A100 80GB with 8x 200 Gb/s HDR per node.
    "A100-80GB": GPUSpec("A100-80GB", 312e12, 19.5e12, 80 * GiB, 2039 * GB, 300 * GB, 25 * GB,
                         gemm_efficiency=0.8),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity = 989.4 dense,
    # FP32 67 TFLOPS, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (bidirectional). DGX H100
    # datasheet: 8x ConnectX-7 400 Gb/s NDR, one per GPU = 50 GB/s.
    # Memory: what CUDA has, 81,559 MiB (79.6 GiB) on an H100 80GB HBM3, not the datasheet's 80.
    "H100-SXM": GPUSpec("H100-SXM", 989.4e12, 67e12, 81559 * 2**20, 3350 * GB, 450 * GB, 50 * GB,
                        gemm_efficiency=0.75, host_bw=50 * GB, host_bytes=256 * GB,  # PCIe Gen5 x16: 64 GB/s raw
                        fp8_flops=1978.9e12),  # same datasheet: FP8 3,958 TFLOPS with sparsity = 1,979 dense
    # H800 SXM (the export H100 DeepSeek-V3 trained on, arXiv:2412.19437 section 3.1): H100 SXM's compute and
    # HBM, NVLink 400 GB/s (bidirectional) instead of 900; each node 8x 400 Gb/s InfiniBand, one per GPU
    "H800": GPUSpec("H800", 989.4e12, 67e12, 80 * GiB, 3350 * GB, 200 * GB, 50 * GB,
                    gemm_efficiency=0.75, host_bw=50 * GB, host_bytes=256 * GB, fp8_flops=1978.9e12),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): same compute as H100 SXM (989 dense BF16,
    # 67 FP32), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; DGX H200: 8x 400 Gb/s NDR.
    "H200": GPUSpec("H200", 989.4e12, 67e12, 141 * GB, 4800 * GB, 450 * GB, 50 * GB,
                    gemm_efficiency=0.75, host_bw=50 * GB, host_bytes=256 * GB,
                    fp8_flops=1978.9e12),  # H200 datasheet: FP8 3,958 TFLOPS with sparsity
    # NVIDIA DGX B200 datasheet: 72 PFLOPS FP8 training for 8 GPUs = 4.5 PF FP8 dense per GPU,
    # so 2.25 PF BF16 dense; 1,440 GB HBM3e total = 180 GB per GPU at 8 TB/s (HGX B200 spec
    # sheet, FP32 75 TFLOPS); NVLink 5 1.8 TB/s per GPU (bidirectional); 8x 400 Gb/s ConnectX-7.
    "B200": GPUSpec("B200", 2250e12, 75e12, 180 * GB, 8000 * GB, 900 * GB, 50 * GB,
                    gemm_efficiency=0.7, host_bw=50 * GB, host_bytes=512 * GB,
                    fp8_flops=4500e12),  # the 72 PFLOPS FP8 / 8 above
}
HEADROOM = 0.05  # of each datasheet GPU's memory, kept free by plans (GPUSpec.headroom_bytes)
GPUS = {name: dataclasses.replace(g, headroom_bytes=HEADROOM * g.hbm_bytes) for name, g in GPUS.items()}


def gpu_spec(name_or_path: str) -> GPUSpec:
    """A known device by name (case-insensitive), or a TOML file path; otherwise a
    :class:`PlanError` listing the known names."""
    for key, spec in GPUS.items():
        if key.lower() == name_or_path.lower():
            return spec
    if name_or_path.endswith(".toml"):
        return load_gpu_toml(name_or_path)
    raise PlanError(f"unknown GPU {name_or_path!r}; known: {', '.join(GPUS)} "
                    "(or pass a TOML file with a [gpu] table, see hybridpar.planner.machine.hardware)")


_FIELDS = {f.name: f for f in dataclasses.fields(GPUSpec) if f.name not in ("calibration", "efficiency")}


def load_gpu_toml(path: str | Path) -> GPUSpec:
    """A :class:`GPUSpec` from a TOML ``[gpu]`` table. ``base = "H100-SXM"`` starts from a known
    device; other keys are GPUSpec field names (units as in the dataclass). An optional
    ``[calibration]`` table (written by ``hybridpar calibrate``) becomes :class:`Calibration`."""
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"GPU spec file {str(p)!r} does not exist")
    try:
        doc = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"GPU spec file {str(p)!r} is not valid TOML: {e}") from None
    data = doc.get("gpu")
    if not isinstance(data, dict):
        raise PlanError(f"GPU spec file {str(p)!r} needs a [gpu] table")
    data = dict(data)
    calibration = _calibration(doc["calibration"], p) if "calibration" in doc else None
    eff = doc.get("efficiency")
    if eff is not None and not isinstance(eff, dict):
        raise PlanError(f"{p}: efficiency must be an [efficiency] table")
    base = gpu_spec(str(data.pop("base"))) if "base" in data else None
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise PlanError(f"{p}: unknown [gpu] keys {unknown}; known: {sorted(_FIELDS)}")
    for key, value in data.items():
        want = str if key == "name" else float
        if want is float and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise PlanError(f"{p}: gpu.{key} = {value!r} must be a number")
        if want is str and not isinstance(value, str):
            raise PlanError(f"{p}: gpu.{key} = {value!r} must be a string")
    values: dict[str, Any] = {k: (v if k == "name" else float(v)) for k, v in data.items()}
    if calibration is not None:
        values["calibration"] = calibration
    if base is not None:
        spec = dataclasses.replace(base, **values)
    else:
        missing = [n for n, f in _FIELDS.items() if f.default is dataclasses.MISSING and n not in data]
        if missing:
            raise PlanError(f"{p}: [gpu] lacks {missing} (or set base = one of {list(GPUS)})")
        spec = GPUSpec(**values)
    if eff is None:
        return spec
    # keys the [efficiency] table leaves out keep the device's own (its family default)
    return dataclasses.replace(spec, efficiency=from_table(eff, str(p), efficiency_of(spec)))


def _numbers(value: object, width: int, where: str) -> tuple[tuple[float, ...], ...]:
    """A list of ``width``-number rows, or a PlanError naming ``where``."""
    ok = isinstance(value, list) and all(
        isinstance(r, list) and len(r) == width
        and all(isinstance(x, int | float) and not isinstance(x, bool) for x in r) for r in value)
    if not ok:
        raise PlanError(f"{where} must be a list of [{width} numbers] rows")
    return tuple(tuple(float(x) for x in r) for r in value)  # type: ignore[union-attr]


def _calibration(data: object, p: Path) -> Calibration:
    """The ``[calibration]`` table of a profile, checked key by key (plain data only)."""
    if not isinstance(data, dict):
        raise PlanError(f"{p}: calibration must be a [calibration] table")
    known = {"device", "dtype", "backend", "threads", "gemm", "attention", "comm", "source", "block",
             "concurrency", "overlap"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise PlanError(f"{p}: unknown [calibration] keys {unknown}; known: {sorted(known)}")
    fits = []
    for i, row in enumerate(data.get("comm", [])):
        where = f"{p}: calibration.comm[{i}]"
        if not isinstance(row, dict) or set(row) - {"op", "size", "alpha", "beta", "points"}:
            raise PlanError(f"{where} must be a table with op, size, alpha, beta (and points)")
        if row.get("op") not in COMM_OPS:
            raise PlanError(f"{where}.op = {row.get('op')!r}; known: {list(COMM_OPS)}")
        size, alpha, beta = row.get("size"), row.get("alpha"), row.get("beta")
        if not (isinstance(size, int) and size >= 2 and isinstance(alpha, int | float)
                and isinstance(beta, int | float) and alpha >= 0 and beta >= 0):
            raise PlanError(f"{where} needs size >= 2 and alpha, beta >= 0 (seconds, seconds per byte)")
        fits.append(CommFit(row["op"], size, float(alpha), float(beta)))
    threads = data.get("threads", 1)
    if not isinstance(threads, int) or threads < 1:
        raise PlanError(f"{p}: calibration.threads = {threads!r} must be an integer >= 1")
    text = {k: data.get(k, d) for k, d in (("device", "cpu"), ("dtype", "fp32"), ("backend", "gloo"))}
    for k, v in text.items():
        if not isinstance(v, str):
            raise PlanError(f"{p}: calibration.{k} = {v!r} must be a string")
    gemm = _numbers(data.get("gemm", []), 4, f"{p}: calibration.gemm")
    attention = _numbers(data.get("attention", []), 4, f"{p}: calibration.attention")
    block = _numbers([data["block"]], 2, f"{p}: calibration.block")[0] if "block" in data else None
    concurrency = _numbers(data.get("concurrency", []), 3, f"{p}: calibration.concurrency")
    if any(r[0] < 1 or not 0 < r[1] <= 2 or not 0 < r[2] <= 2 for r in concurrency):
        raise PlanError(f"{p}: calibration.concurrency rows are [ranks >= 1, GEMM fraction, element-wise fraction]")
    overlap = data.get("overlap")
    if overlap is not None and (isinstance(overlap, bool) or not isinstance(overlap, int | float)
                                or not 0 <= overlap <= 1):
        raise PlanError(f"{p}: calibration.overlap = {overlap!r} must be a fraction in [0, 1]")
    return Calibration(text["device"], text["dtype"], text["backend"], threads, gemm, attention,
                       tuple(fits), block, concurrency,  # type: ignore[arg-type]
                       None if overlap is None else float(overlap))


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``gpus_per_node`` identical GPUs."""

    gpu: GPUSpec
    gpus_per_node: int
    nodes: int

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @classmethod
    def of(cls, gpu: GPUSpec, gpus: int, gpus_per_node: int = 8) -> Cluster:
        """``gpus`` GPUs in nodes of ``gpus_per_node`` (a partial node if fewer)."""
        if gpus < 1 or gpus_per_node < 1:
            raise PlanError(f"--gpus {gpus} and --gpus-per-node {gpus_per_node} must be >= 1")
        if gpus <= gpus_per_node:
            return cls(gpu, gpus, 1)
        if gpus % gpus_per_node:
            raise PlanError(f"--gpus {gpus} is not a whole number of {gpus_per_node}-GPU nodes; "
                            f"use a multiple of {gpus_per_node} or set --gpus-per-node")
        return cls(gpu, gpus_per_node, gpus // gpus_per_node)

    @functools.cached_property
    def rank_gpu(self) -> GPUSpec:
        """The device as each rank sees it with ``gpus_per_node`` ranks busy on a node: a
        calibrated profile's concurrency fractions applied to its compute rates and bandwidth
        (identical to ``gpu`` for separate accelerators, which share nothing)."""
        cal = self.gpu.calibration
        if cal is None or not cal.concurrency:
            return self.gpu
        f_gemm, f_mem = cal.slowdown(self.gpus_per_node)
        if f_gemm == 1.0 and f_mem == 1.0:
            return self.gpu
        scaled = dataclasses.replace(
            cal, gemm=tuple((m, n, k, r * f_gemm) for m, n, k, r in cal.gemm),
            attention=tuple((sq, d, f * f_gemm, b * f_gemm) for sq, d, f, b in cal.attention))
        return dataclasses.replace(self.gpu, bf16_flops=self.gpu.bf16_flops * f_gemm,
                                   fp32_flops=self.gpu.fp32_flops * f_gemm, hbm_bw=self.gpu.hbm_bw * f_mem,
                                   calibration=scaled)

    def axis_bandwidth(self, size: int, stride: int) -> tuple[float, float, bool]:
        """(bus bandwidth bytes/s, per-step latency s, within one node) of a ring over ``size``
        ranks spaced ``stride`` apart in rank order (tp innermost, then cp, dp, pp).

        Inside a node: NVLink. Across nodes with ``g`` members per node the ring's node-crossing
        traffic spreads over those members' ``g`` NICs: ``min(NVLink, g * NIC)``."""
        g = self.gpu
        if size <= 1:
            return float("inf"), 0.0, True
        if size * stride <= self.gpus_per_node:
            return g.intra_bw * g.comm_efficiency, g.intra_latency, True
        per_node = max(1, self.gpus_per_node // stride)
        return min(g.intra_bw, per_node * g.inter_bw) * g.comm_efficiency, g.inter_latency, False

    def collective_time(self, op: str, nbytes: float, size: int, stride: int) -> float:
        """Seconds of one ``op`` (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``send``)
        with ``nbytes`` payload (as the comm counter records it) over an axis of ``size`` ranks
        spaced ``stride`` apart.

        A calibrated profile's measured ``alpha + beta * bytes`` is used inside a node (what
        ``hybridpar calibrate`` can measure); otherwise the ring model over
        :meth:`axis_bandwidth`: ``steps * latency + ring bytes / bus bandwidth``, and a p2p send
        at the link's full bandwidth."""
        if size <= 1:
            return 0.0
        cal = self.gpu.calibration
        if cal is not None and size * stride <= self.gpus_per_node:
            measured = cal.comm_time(op, nbytes, size)
            if measured is not None:
                return measured
        bw, lat, _ = self.axis_bandwidth(size, stride)
        if op == "send":
            return nbytes / (bw / self.gpu.comm_efficiency) + lat
        return _RING_STEPS[op](size) * lat + _RING_BYTES[op](size) * nbytes / bw


CPU_CORE = GPUSpec("cpu core (uncalibrated)", bf16_flops=60e9, fp32_flops=60e9, hbm_bytes=4 * GiB,
                   hbm_bw=10 * GB, intra_bw=1 * GB, inter_bw=1 * GB, intra_latency=200e-6,
                   inter_latency=200e-6, gemm_efficiency=1.0, comm_efficiency=1.0,
                   launch_overhead=5e-6, host_bw=10 * GB)
