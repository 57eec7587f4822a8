"""Accelerator specs and cluster shape: the physical constants the planner's models divide by.

Every number carries its public source. Bandwidths are bytes/s *per GPU, per direction*:
``intra_bw`` is the GPU's NVLink/NVSwitch bandwidth inside a node, ``inter_bw`` the network
bandwidth of the NIC(s) attached to one GPU (DGX/HGX systems have one NIC per GPU). Peaks are
dense (no 2:4 sparsity). Two efficiencies are device constants, not per-layout fudge factors:
``gemm_efficiency`` (the fraction of peak a large, well-shaped cuBLAS GEMM reaches) and
``comm_efficiency`` (NCCL bus bandwidth over link bandwidth); ``hybridpar calibrate`` is meant to
measure them. Custom devices load from TOML (:func:`load_gpu_toml`).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path

from hybridpar.errors import UserError

GB = 1e9
GiB = 2**30


class PlanError(UserError):
    """Bad planner input (unknown device or preset, impossible cluster); the message names the fix."""


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
    "H100-SXM": GPUSpec("H100-SXM", 989.4e12, 67e12, 80 * GiB, 3350 * GB, 450 * GB, 50 * GB,
                        gemm_efficiency=0.75, host_bw=50 * GB),  # PCIe Gen5 x16: 64 GB/s raw
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): same compute as H100 SXM (989 dense BF16,
    # 67 FP32), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; DGX H200: 8x 400 Gb/s NDR.
    "H200": GPUSpec("H200", 989.4e12, 67e12, 141 * GB, 4800 * GB, 450 * GB, 50 * GB,
                    gemm_efficiency=0.75, host_bw=50 * GB),
    # NVIDIA DGX B200 datasheet: 72 PFLOPS FP8 training for 8 GPUs = 4.5 PF FP8 dense per GPU,
    # so 2.25 PF BF16 dense; 1,440 GB HBM3e total = 180 GB per GPU at 8 TB/s (HGX B200 spec
    # sheet, FP32 75 TFLOPS); NVLink 5 1.8 TB/s per GPU (bidirectional); 8x 400 Gb/s ConnectX-7.
    "B200": GPUSpec("B200", 2250e12, 75e12, 180 * GB, 8000 * GB, 900 * GB, 50 * GB,
                    gemm_efficiency=0.7, host_bw=50 * GB),
}


def gpu_spec(name_or_path: str) -> GPUSpec:
    """A known device by name (case-insensitive), or a TOML file path; otherwise a
    :class:`PlanError` listing the known names."""
    for key, spec in GPUS.items():
        if key.lower() == name_or_path.lower():
            return spec
    if name_or_path.endswith(".toml"):
        return load_gpu_toml(name_or_path)
    raise PlanError(f"unknown GPU {name_or_path!r}; known: {', '.join(GPUS)} "
                    "(or pass a TOML file with a [gpu] table, see hybridpar.planner.hardware)")


_FIELDS = {f.name: f for f in dataclasses.fields(GPUSpec)}


def load_gpu_toml(path: str | Path) -> GPUSpec:
    """A :class:`GPUSpec` from a TOML ``[gpu]`` table. ``base = "H100-SXM"`` starts from a known
    device; other keys are GPUSpec field names (units as in the dataclass)."""
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"GPU spec file {str(p)!r} does not exist")
    try:
        data = tomllib.loads(p.read_text()).get("gpu")
    except tomllib.TOMLDecodeError as e:
        raise PlanError(f"GPU spec file {str(p)!r} is not valid TOML: {e}") from None
    if not isinstance(data, dict):
        raise PlanError(f"GPU spec file {str(p)!r} needs a [gpu] table")
    data = dict(data)
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
    if base is not None:
        return dataclasses.replace(base, **{k: (v if k == "name" else float(v)) for k, v in data.items()})
    missing = [n for n, f in _FIELDS.items() if f.default is dataclasses.MISSING and n not in data]
    if missing:
        raise PlanError(f"{p}: [gpu] lacks {missing} (or set base = one of {list(GPUS)})")
    return GPUSpec(**{k: (v if k == "name" else float(v)) for k, v in data.items()})


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
