"""Memory the allocator and the process hold beyond the live tensors: the planner's ``overhead``
component (:mod:`hybridpar.planner.memory.plan`) on GPUs, and the resident set of a CPU rank.

GPU (what ``torch.cuda.max_memory_reserved`` plus the context show, i.e. what must fit):

* the CUDA context of the process: ~0.5 GiB with CUDA 12's lazy module loading (PyTorch "CUDA
  semantics" notes: the context takes 300 MiB-1 GiB depending on the device and loaded kernels;
  lazy loading, the default since CUDA 11.7 / torch 2.x, keeps it near the low end);
* cuBLAS/cuBLASLt workspaces: 4 MiB x 8 chunks each (``CUBLAS_WORKSPACE_CONFIG``'s default
  ``:4096:8``), for the compute stream and the side streams (3 here);
* NCCL's buffers once there are peers: ``NCCL_BUFFSIZE`` 4 MiB per channel and direction, up to 32
  channels on NVLink: ~0.25 GiB per communicator, one per mesh axis of size > 1;
* the caching allocator's fragmentation: model states are allocated once, in whole segments, and
  never freed (none); activations are freed and re-allocated every micro-batch, and blocks split
  off a cached segment cannot merge with their neighbours' segments, so reserved exceeds the peak
  of allocated by a fraction of the activation churn: 8% (PyTorch caching-allocator notes; the
  ``expandable_segments`` option exists to remove exactly this).

CPU (a rank's peak resident set, ``summary.json``'s ``peak_memory_bytes_per_rank`` on CPU):
the interpreter with torch, this library and the trainer's loggers loaded
(:data:`CPU_BASELINE_BYTES`, measured on this project's machine with torch 2.x on Linux x86-64: a
``hybridpar train`` run of a one-layer dim-32 model peaks at 340 MiB; ``import torch,
hybridpar.training.trainer`` alone is 302 MiB), the live tensors,
and the transients of the step that the live-tensor model does not hold: backward's activation
gradients (about one layer's activations at a time) and the optimizer step's temporaries (the
foreach AdamW's per-parameter intermediates: one fp32 parameter-sized buffer); glibc keeps the
freed heap (``hybridpar.keep_host_heap``), so the high-water mark is what counts.
"""

from __future__ import annotations

import functools
import subprocess
import sys

GiB = 2**30
MiB = 2**20

CUDA_CONTEXT_BYTES = 0.5 * GiB
CUBLAS_WORKSPACE_BYTES = 3 * 2 * 32 * MiB  # 3 streams x (cuBLAS + cuBLASLt) x 4 MiB x 8
NCCL_COMMUNICATOR_BYTES = 0.25 * GiB
ACTIVATION_FRAGMENTATION = 0.08
CPU_BASELINE_BYTES = 340 * MiB
RUN_OVER_IMPORT_BYTES = 38 * MiB  # a run's baseline over ``import torch, hybridpar.training.trainer``
_IMPORT_RSS = ("import resource, torch, hybridpar.training.trainer; "
               "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")


def gpu_overhead(activations: float, communicators: int) -> float:
    """Bytes a GPU rank holds beyond its live tensors (module doc): context, workspaces, NCCL
    buffers for ``communicators`` mesh axes with peers, and fragmentation of ``activations``
    (activation and logits bytes at the peak)."""
    return (CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + NCCL_COMMUNICATOR_BYTES * communicators
            + ACTIVATION_FRAGMENTATION * activations)


def communicators(dp: int, tp: int, pp: int, cp: int) -> int:
    """Mesh axes with more than one rank (each gets its own NCCL communicator)."""
    return sum(1 for n in (dp, tp, pp, cp) if n > 1)


@functools.cache
def measured_cpu_baseline() -> float:
    """:data:`CPU_BASELINE_BYTES` for this machine and environment: the resident set of a fresh
    interpreter that imported torch and the trainer, plus what a run adds before its model
    (:data:`RUN_OVER_IMPORT_BYTES`). The import's resident set is not a constant: the same venv
    measured 302 MiB in one checkout of this machine and 354 MiB in a fresh clone (how much of
    the shared libraries the loader maps differs). The constant where it cannot be measured
    (Linux's ``ru_maxrss`` is in KiB)."""
    if not sys.platform.startswith("linux"):
        return CPU_BASELINE_BYTES
    try:
        # through a small interpreter: Linux carries the peak resident set over fork + exec, so a
        # child of this (possibly large) process would report this process's peak
        bare = [sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"]
        out = subprocess.run([*bare, sys.executable, "-c", _IMPORT_RSS], capture_output=True, text=True,
                             timeout=300, check=True)
        return int(out.stdout.split()[-1]) * 1024 + RUN_OVER_IMPORT_BYTES
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return CPU_BASELINE_BYTES


def cpu_resident_bytes(live: float, layer_activations: float, optimizer_shard: float,
                       baseline: float = CPU_BASELINE_BYTES) -> float:
    """Predicted peak resident set of a CPU rank (module doc): the ``baseline``, ``live`` tensor
    bytes at the peak (states, activations, logits, buffers), one layer's activations of
    backward transients and a parameter-sized fp32 optimizer temporary (``optimizer_shard``
    elements)."""
    return baseline + live + layer_activations + 4 * optimizer_shard
