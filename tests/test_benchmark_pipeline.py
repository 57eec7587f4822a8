"""benchmarks/pipeline.py on a torch whose torch.distributed.pipelining V-shaped schedules cannot
set up over gloo (2.11: "Pair is not connected" in _initialize_stages): those rows run only our
side, saying why; the others still compare with torch."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import pipeline as bench  # noqa: E402


def test_v_shaped_torch_rows_are_skipped_with_their_reason_before_2_13(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu126")
    reason = bench.torch_row_skipped("zbv")
    assert reason is not None and "torch 2.11.0+cu126 < 2.13" in reason and "Pair is not connected" in reason
    assert all(bench.torch_row_skipped(name) is None for name in ("gpipe", "1f1b", "interleaved", "zb-h1"))
    assert "dualpipev" not in dict(bench.torch_rows(4, 8))  # a torch-only row has nothing to show
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    assert bench.torch_row_skipped("zbv") is None and bench.torch_row_skipped("dualpipev") is None
