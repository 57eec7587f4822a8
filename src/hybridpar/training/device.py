"""The one place that knows about accelerators: device choice, peak FLOP/s, memory, sync.

Generic code asks this module instead of calling ``torch.cuda`` so every path also runs on CPU.
"""

from __future__ import annotations

import os
import resource
import sys
import time

import torch

# Dense (no sparsity) peak matmul throughput in FLOP/s per device, from the vendors' data sheets.
# A100: NVIDIA A100 datasheet (312 TFLOP/s bf16/fp16, 19.5 fp32 / 156 tf32).
# H100 SXM: NVIDIA H100 datasheet (989 TFLOP/s bf16 dense; 67 fp32). H200: same compute as H100.
# B200: NVIDIA DGX B200 datasheet (2.25 PFLOP/s bf16 dense per GPU).
_GPU_PEAKS: list[tuple[str, dict[str, float]]] = [
    ("B200", {"bf16": 2.25e15, "fp16": 2.25e15, "fp32": 80e12}),
    ("H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
]


def pick_device(choice: str = "auto", local_rank: int = 0) -> torch.device:
    """``cuda:<local_rank>`` when asked for (or available under ``auto``), else CPU."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("train.device = 'cuda' but no CUDA device is visible; use train.device = 'cpu'")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for queued device work so wall-clock timings mean something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured_matmul_flops(dtype: torch.dtype = torch.float32, n: int = 512, reps: int = 8) -> float:
    """FLOP/s of an n x n matmul on this CPU process, the best of a few runs."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def peak_flops(device: torch.device, precision: str) -> tuple[float, str]:
    """(peak FLOP/s, where the number came from) for MFU: a data-sheet table on known GPUs,
    a measured matmul rate on CPU or on an unknown GPU."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in _GPU_PEAKS:
            if key in name:
                return peaks.get(precision, peaks["fp32"]), f"{key} data sheet"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return measured_matmul_flops(dtype), "measured matmul"


def memory_bytes(device: torch.device) -> int:
    """Peak memory so far: allocator peak on CUDA, the process's peak resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def local_rank() -> int:
    """This process's index on its node, from the launcher (0 without one)."""
    return int(os.environ.get("LOCAL_RANK", "0"))
