"""benchmarks/pipeline.py on a torch whose torch.distributed.pipelining side cannot run over gloo
(2.11: "Pair is not connected" in _initialize_stages): that side is skipped, saying why."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import pipeline as bench  # noqa: E402


def test_torch_side_is_skipped_with_its_reason_before_2_13(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu126")
    reason = bench.torch_side_skipped()
    assert reason is not None and "torch 2.11.0+cu126 < 2.13" in reason and "Pair is not connected" in reason
    assert "dualpipev" not in dict(bench.torch_rows(4, 8))  # a torch-only row has nothing to show
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    assert bench.torch_side_skipped() is None
