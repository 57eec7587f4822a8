"""The one place that knows about accelerators: device choice, peak FLOP/s, memory, sync.

Generic code asks this module instead of calling ``torch.cuda`` so every path also runs on CPU.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import time

import torch

from hybridpar.errors import UserError


class DeviceError(UserError):
    """``train.device`` asks for accelerators this machine does not have."""

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


#: The test mode that runs several ranks on one GPU (see :func:`shared_gpu`).
SHARED_GPU_ENV = "HYBRIDPAR_SHARED_GPU"


def shared_gpu() -> bool:
    """Whether every local rank runs on CUDA device 0 (``HYBRIDPAR_SHARED_GPU=1``), a test mode.

    NCCL refuses two ranks on one device, so in this mode the process groups are gloo and the
    collectives stage CUDA tensors through host memory (:mod:`hybridpar.distributed.comm`). It
    exists to run multi-rank layouts with CUDA tensors on a one-GPU machine, which finds device
    placement bugs (a CPU tensor in a CUDA path, pinned memory and stream misuse) that gloo on CPU
    cannot; its speed means nothing."""
    return os.environ.get(SHARED_GPU_ENV, "") not in ("", "0")


def local_world_size() -> int:
    """Processes on this node, from the launcher (1 without one)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def gpus_fit(local_processes: int) -> bool:
    """One CUDA device per local process is visible (the layout every rank assumes)."""
    return accelerator_count() >= local_processes > 0


def resolve_device_type(choice: str, local_processes: int) -> str:
    """``train.device`` for ``local_processes`` ranks on this node -> ``"cuda"`` or ``"cpu"``.

    ``auto`` takes the GPUs only when there is one per local process (two ranks cannot share a
    GPU under NCCL), and CPU otherwise; ``cuda`` without enough GPUs is an error naming the
    counts, raised before any process starts.
    """
    if choice == "cuda":
        have = accelerator_count()
        if have == 0:
            raise DeviceError("train.device = 'cuda' but no CUDA device is visible; set train.device = 'cpu' "
                              "(or 'auto', which picks CUDA when there is one GPU per process)")
        if have < local_processes and not shared_gpu():
            raise DeviceError(f"train.device = 'cuda' with {local_processes} processes on this node but "
                              f"{have} CUDA device(s) visible; launch at most {have} processes per node "
                              "(--nproc / --nproc-per-node), set train.device = 'cpu', or, to test a layout "
                              f"with CUDA tensors on one GPU, set {SHARED_GPU_ENV}=1")
        return "cuda"
    return "cuda" if choice == "auto" and gpus_fit(local_processes) else "cpu"


def pick_device(choice: str = "auto", local_rank: int = 0, local_processes: int | None = None) -> torch.device:
    """This process's device: ``cuda:<local_rank>`` (see :func:`resolve_device_type`; ``cuda:0``
    for every rank under :func:`shared_gpu`), else CPU."""
    local_processes = local_world_size() if local_processes is None else local_processes
    if resolve_device_type(choice, local_processes) == "cuda":
        local_rank = 0 if shared_gpu() else local_rank
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def prefers_gpu(choice: str) -> bool:
    """Whether ``train.device = choice`` runs on GPUs when one process is launched per GPU."""
    return choice == "cuda" or (choice == "auto" and accelerator_count() > 0)


def accelerator_count() -> int:
    """CUDA devices visible to this process (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_name(device: torch.device) -> str:
    """The GPU's marketing name (``NVIDIA H100 80GB HBM3``), or ``cpu``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def fp8_supported(device: torch.device) -> bool:
    """Whether ``device`` has FP8 matmul kernels (``torch._scaled_mm``): CPU (torch's reference
    kernel, 2.13), or a CUDA GPU of capability 8.9 (Ada) or later, where FP8 tensor cores exist."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


def total_memory(device: torch.device) -> int:
    """Capacity in bytes: the GPU's memory, or this machine's RAM for ``cpu``."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def synchronize(device: torch.device) -> None:
    """Wait for queued device work so wall-clock timings mean something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured_matmul_flops(dtype: torch.dtype = torch.float32, n: int = 512, reps: int = 8,
                          device: torch.device | None = None) -> float:
    """FLOP/s of the n x n matmul a training step runs on ``device`` (default CPU), the best of a
    few runs.

    ``dtype`` is the step's compute dtype: fp32 runs a plain fp32 matmul; bf16/fp16 run ``F.linear``
    on fp32 tensors under CPU autocast, which is what the model's layers do (cast, then the
    low-precision GEMM), not a matmul of tensors already in bf16 that the step never runs."""
    device = torch.device("cpu") if device is None else device
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    if dtype == torch.float32:
        def run() -> None:
            a @ b
    else:
        def run() -> None:
            with torch.autocast(device_type=device.type, dtype=dtype):
                torch.nn.functional.linear(a, b)
    run()  # warm-up
    best = float("inf")
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        run()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def peak_flops(device: torch.device, precision: str) -> tuple[float, str]:
    """(peak FLOP/s, where the number came from) for MFU: a data-sheet table on known GPUs,
    a measured matmul rate on CPU or on an unknown GPU, in the kernels the step runs under
    ``precision`` (see :func:`measured_matmul_flops`).

    A measured rate is only a lower bound of the peak (a loaded machine measures less), so the
    MFU computed from it can exceed 1; :class:`hybridpar.training.loop.ThroughputMeter` reports
    such a window's MFU as unknown (None) rather than above 100%."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in _GPU_PEAKS:
            if key in name:
                return peaks.get(precision, peaks["fp32"]), f"{key} data sheet"
    dtype = _COMPUTE_DTYPES.get(precision, torch.float32)
    return measured_matmul_flops(dtype, device=device), f"measured {precision} matmul"


def memory_bytes(device: torch.device) -> int:
    """Peak memory so far: allocator peak on CUDA, the process's peak resident set on CPU.

    On Linux the peak is ``VmHWM`` of ``/proc/self/status`` (this address space's high-water
    mark), not ``ru_maxrss``: Linux carries ``ru_maxrss`` over fork and exec, so a run started
    from a larger process (a test runner, a notebook) reported that process's peak."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _status_kib(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (None where there is no such file or field)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def local_rank() -> int:
    """This process's index on its node, from the launcher (0 without one)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_HEAP_KEPT = 1 << 30  # mallopt takes an int: 1 GiB
_USER_MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "LD_PRELOAD")
KEEP_HOST_HEAP_ENV = "HYBRIDPAR_KEEP_HOST_HEAP"  # "0": leave glibc's malloc at its defaults
_host_heap_kept: bool | None = None


def keep_host_heap() -> bool:
    """Have glibc's malloc keep the memory a training step frees for the next step instead of
    returning it to the kernel; True when the setting is in effect (once per process).

    Why: glibc gives freed heap memory back to the kernel once the free space at the top of the
    heap exceeds ``M_TRIM_THRESHOLD`` (dynamic: twice the largest freed mmapped block, a few MB
    for these tensors), and serves blocks above ``M_MMAP_THRESHOLD`` from fresh mappings. A step
    that frees and re-allocates tens of MB of activations and gradients then takes every page back
    from the kernel with a page fault (zeroed, ~2 us per 4 KiB). Measured on the
    ``benchmarks/pipeline.py --compute`` stages (pp=2, M=4): ~10,000 faults and 20-30 ms of system
    time per 650 ms ZBV step, mostly in W, whose weight-gradient temporaries are allocated while
    little else is being freed; 0-300 with both thresholds fixed at 1 GiB (which also turns the
    dynamic adjustment off). The cost: the process keeps its peak heap mapped (a training step
    reaches that peak again every step).

    Only with glibc on Linux, and not when the user tuned malloc (``MALLOC_*_`` variables,
    ``GLIBC_TUNABLES`` with ``glibc.malloc``), preloads another allocator (``LD_PRELOAD``) or sets
    ``HYBRIDPAR_KEEP_HOST_HEAP=0``.
    """
    global _host_heap_kept
    if _host_heap_kept is not None:
        return _host_heap_kept
    _host_heap_kept = False
    if not sys.platform.startswith("linux") or os.environ.get(KEEP_HOST_HEAP_ENV) == "0" \
            or any(os.environ.get(k) for k in _USER_MALLOC_ENV) \
            or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt if hasattr(libc, "gnu_get_libc_version") else None  # glibc only (not musl)
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _host_heap_kept = bool(mallopt(_M_MMAP_THRESHOLD, _HEAP_KEPT)) and bool(mallopt(_M_TRIM_THRESHOLD, _HEAP_KEPT))
    return _host_heap_kept


class CopyStream:
    """Host <-> device copies beside compute: a side stream and its events on CUDA, plain
    synchronous copies elsewhere (on CPU "host" memory is the same memory, so a copy is a separate
    buffer and nothing overlaps). Activation offload (:mod:`hybridpar.parallel.offload_activations`)
    asks this instead of calling ``torch.cuda``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.asynchronous = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.asynchronous else None

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """An empty byte buffer in host memory (pinned on CUDA, so copies into it are asynchronous)."""
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.asynchronous)

    def to_host(self, source: torch.Tensor, host: torch.Tensor) -> None:
        """Copy ``source`` (bytes on the device) into ``host``: on the side stream, after the work
        queued so far on the current stream (which produced it); ``source``'s memory is not reused
        before the copy has read it."""
        if self._stream is None:
            host.copy_(source)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(source, non_blocking=True)
        source.record_stream(self._stream)

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        """A device copy of ``host`` started on the side stream, and the event that marks it done
        (on CPU ``host`` itself, already the separate buffer the offload copied into, and None)."""
        if self._stream is None:
            return host, None
        with torch.cuda.stream(self._stream):
            out = host.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return out, event

    def wait(self, tensor: torch.Tensor, event: object | None) -> None:
        """Make the current stream wait for ``tensor``'s copy (``event``) before using it, and keep
        its memory from reuse on the side stream while the current one reads it."""
        if event is None:
            return
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)  # type: ignore[arg-type]
        tensor.record_stream(stream)
