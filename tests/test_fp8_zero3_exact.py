"""FP8 tensorwise under ZeRO-3 trains what one process trains, bit for bit, with clipping on.

**Why exact.** With one micro-batch per dp rank (global batch = dp x micro-batch) the averaged
gradient is one addition of two values, so each gradient element is the one process's exactly
(its two micro-batches summed in either order), and ZeRO-3's row shards hold those elements.
What remained was the clipping norm: summed in fp32, a shard's sum of squares rounds where the
whole tensor's does not, the norm differed in its last bit, and through the clipping coefficient
an FP8 cast's input crossed an e4m3 rounding midpoint (the tiny preset's 5 steps: weights 9.2e-4
apart, ``hybridpar compare`` said "NOT expected"). ``sum_of_squares`` sums in fp64, where every
square is exact and the rounding of the sums (below ``n * 2**-53``) is far under half an fp32
step, so the fp32 norm is the same however the elements are split between tensors and ranks.

Where FP8 runs still part (more micro-batches per rank, other GEMM blocking: the tiny preset's
ZeRO-3 run), ``hybridpar compare`` holds them to the format's bound through Adam
(``training/compare.py``'s module doc): checked against the formula here.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from layouts import Run, reference, train_layout

from hybridpar.parallel.tensor_plan import sum_of_squares
from hybridpar.training.compare import fp8_weight_tolerance

pytestmark = pytest.mark.numerics

# one micro-batch per rank at dp2 (two in one process), clipping on (train.grad_clip 1.0, the
# default, clips every step of this run), 5 steps: the old fp32 norm parted the runs at step 4
FLAGS = ("--model.dim", "64", "--fp8.recipe", "tensorwise", "--train.global_batch", "4",
         "--train.grad_clip", "1.0")
ZERO3 = ("--parallel.dp", "2", "--parallel.zero_stage", "3")


def test_fp8_tensorwise_zero3_with_clipping_equals_one_process_bit_for_bit(tmp_path: Any) -> None:
    expected = reference(Run(str(tmp_path), FLAGS, steps=5))
    results = train_layout(Run(str(tmp_path), (*FLAGS, *ZERO3), steps=5), timeout=600)
    for rank, r in enumerate(results):
        assert r.losses == expected.losses, f"rank {rank}"
    for name, w in results[0].state.items():
        assert torch.equal(w, expected.state[name]), name


def test_the_norm_does_not_depend_on_how_the_rows_are_split() -> None:
    # ZeRO's row shards (torch.chunk, uneven too) and the whole tensor give the same fp32 norm;
    # summed in fp32 (the old foreach norm per tensor) some of these seeds differed in the last bit
    cpu = torch.device("cpu")
    for seed in range(20):
        g = torch.randn(997, 64, generator=torch.Generator().manual_seed(seed)) * 1e-3
        whole = sum_of_squares([g], cpu).sqrt().float()
        for n in (2, 3, 8):
            parts = torch.stack([sum_of_squares([c], cpu) for c in g.chunk(n)]).sum()
            assert torch.equal(parts.sqrt().float(), whole), (seed, n)
    assert sum_of_squares([], cpu).dtype == torch.float64


def test_compare_holds_fp8_runs_to_twice_the_summed_lr() -> None:
    # the tiny preset's warm-up (lr 3e-3 over 30 steps): steps 1..5 sum to 3e-3 * 15 / 30; Adam's
    # effective step is at most lr_t with beta1 0.9, beta2 0.95 (1 - 0.9 <= sqrt(1 - 0.95))
    train = {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 30, "steps": 300, "beta1": 0.9, "beta2": 0.95}
    assert fp8_weight_tolerance(train, 5) == pytest.approx(2 * 3e-3 * 15 / 30, rel=1e-12)
    # beta1 0.5: (1 - 0.5) / sqrt(1 - 0.95) = 2.236 x lr_t
    assert fp8_weight_tolerance({**train, "beta1": 0.5}, 5) == pytest.approx(
        2 * 3e-3 * 15 / 30 * 0.5 / math.sqrt(0.05), rel=1e-12)
