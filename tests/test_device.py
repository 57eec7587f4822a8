"""Device choice: ``auto`` uses GPUs only when each local process gets one; ``cuda`` without
enough of them is one clear error before launch (found on a 1-GPU machine with --nproc 2)."""

from __future__ import annotations

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
