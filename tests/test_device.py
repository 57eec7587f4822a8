"""Device choice: ``auto`` uses GPUs only when each local process gets one; ``cuda`` without
enough of them is one clear error before launch (found on a 1-GPU machine with --nproc 2)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hybridpar.distributed.device import DeviceError, resolve_device_type


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    def visible(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return visible


def test_auto_takes_gpus_only_with_one_per_process(gpus) -> None:
    gpus(1)
    assert resolve_device_type("auto", 1) == "cuda"
    assert resolve_device_type("auto", 2) == "cpu"
    gpus(8)
    assert resolve_device_type("auto", 8) == "cuda"
    gpus(0)
    assert resolve_device_type("auto", 1) == "cpu"
    assert resolve_device_type("cpu", 1) == "cpu"


def test_cuda_without_enough_gpus_names_the_counts(gpus) -> None:
    gpus(1)
    assert resolve_device_type("cuda", 1) == "cuda"
    with pytest.raises(DeviceError, match="2 processes on this node but 1 CUDA device"):
        resolve_device_type("cuda", 2)
    gpus(0)
    with pytest.raises(DeviceError, match="no CUDA device is visible"):
        resolve_device_type("cuda", 1)


def test_shared_gpu_test_mode_puts_every_rank_on_gpu_0_over_gloo(gpus, monkeypatch) -> None:
    """``HYBRIDPAR_SHARED_GPU=1`` (benchmarks/gpu_multirank.py): several ranks on one GPU, on
    device 0, with gloo groups (NCCL refuses two ranks on one device); the error without it
    names the setting."""
    from hybridpar.distributed.mesh import _device, backend_for

    gpus(1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv("HYBRIDPAR_SHARED_GPU", raising=False)
    with pytest.raises(DeviceError, match="HYBRIDPAR_SHARED_GPU=1"):
        resolve_device_type("cuda", 4)
    assert backend_for("cuda") == "nccl" and _device("cuda") == torch.device("cuda", 3)
    monkeypatch.setenv("HYBRIDPAR_SHARED_GPU", "1")
    assert resolve_device_type("cuda", 4) == "cuda"
    assert backend_for("cuda") == "gloo" and backend_for("cpu") == "gloo"
    assert _device("cuda") == torch.device("cuda", 0)


def test_staging_leaves_cpu_tensors_alone_even_on_gloo(monkeypatch) -> None:
    """A CPU tensor is handed to gloo as it is: the staging of the one-GPU test mode costs CPU
    runs nothing (no copy, nothing to copy back)."""
    from hybridpar.distributed import staging

    monkeypatch.setattr(staging, "is_gloo", lambda group: True)
    t = torch.arange(4.0)
    host = staging.Host(t, None)
    assert host.host is t and not host.staged and host.then() == [] and host.back() is t


_REALLOC = """
import resource, sys, torch
from hybridpar.distributed.device import keep_host_heap
kept = keep_host_heap()
for _ in range(8):  # 64 MiB: above glibc's largest dynamic mmap threshold (32 MiB); allocated, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 << 20).sum()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)  # faults of the last round
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux only")
def test_kept_host_heap_serves_a_freed_block_again_without_page_faults() -> None:
    """A block freed by one step comes back without taking its pages from the kernel again (one
    minor fault per 4 KiB page otherwise: 16384 for 64 MiB under glibc's defaults). The first
    rounds may still grow the heap (an aligned block needs a little more than the one freed; 4
    rounds here), the eighth reuses it."""
    pages = (64 << 20) // 4096
    runs = {}
    for keep in ("1", "0"):
        env = {**os.environ, "HYBRIDPAR_KEEP_HOST_HEAP": keep}
        out = subprocess.run([sys.executable, "-c", _REALLOC], env=env, capture_output=True, text=True, check=True)
        kept, faults = out.stdout.split()
        runs[keep] = (kept, int(faults))
    assert runs["0"][0] == "False" and runs["0"][1] >= 0.9 * pages  # glibc's defaults: mapped afresh
    assert runs["1"][0] == "True" and runs["1"][1] < 0.05 * pages


_CHILD_PEAK = ("import torch; from hybridpar.distributed.device import memory_bytes; "
               "print(memory_bytes(torch.device('cpu')))")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM (/proc/self/status) and the ru_maxrss carry-over are Linux only")
def test_cpu_peak_is_this_process_not_the_one_that_started_it() -> None:
    """A run started from a large process reports its own peak: Linux keeps ``ru_maxrss`` over
    fork and exec, so with it a child of a process holding 768 MiB reported >= 768 MiB."""
    held = torch.ones(768 * 2**20 // 4)
    held += 1  # resident in this process
    out = subprocess.run([sys.executable, "-c", _CHILD_PEAK], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    child = int(out.stdout.split()[-1])
    assert 0 < child < 768 * 2**20  # the child imports torch (a few hundred MiB), never holds `held`
    del held
