"""FP8 training (``fp8.recipe``) under every parallel axis trains the model one process trains.

**Scales equal.** Every amax over a dimension a rank holds only part of is max-reduced over
the axes that split it (``parallel/fp8``), so each FP8 scale of the first step (weights and
inputs equal everywhere then) equals the single-process one exactly: the tensorwise runs
record every scale of step 1 (forward and backward) on each rank and the union over the ranks
that hold different tokens or layers (dp, pp; tp and cp ranks hold the same scalars) must be
the single-process multiset. One exception, exact too: each rank's loss is the mean over its
own micro-batches and tokens and data/context parallelism averages the gradients afterwards, so
inside backward the output gradients (tensorwise: the e5m2 operands) are ``dp x cp`` times one
process's, and so their amax; for a power-of-two factor (every layout here) the power-of-two
scale is exactly ``1 / (dp x cp)`` of one process's and the quantized elements ``dy * s`` are
identical; the test compares ``scale x dp x cp``. (For dp x cp not a power of two the quantized
gradients would differ by one FP8 rounding, the format's error.) With equal scales, the quantized operands differ only where the
GEMM inputs differ, i.e. by the layouts' fp32 accumulation order.

**Tolerance, from the format.** An accumulation difference of one ulp can move a value across
the midpoint of two FP8 neighbours, so a few quantized elements differ by one FP8 spacing
between layouts (a flip): both choices are within the format's rounding error of the exact
value. Each layout's FP8 run is therefore as far from the one-process FP8 run as two FP8 runs
of the same model can be: at most the sum of their distances from the unquantized run, which
the reference measures: ``|L_layout - L_fp8| <= 2 |L_fp8 - L_none|`` per step after the first
(plus the layout rule's ``LOSS_RTOL``), the first step's loss (no weight has moved yet) to
``LOSS_RTOL`` alone, and every weight tensor's largest difference to twice the reference's
largest FP8-vs-unquantized difference of that tensor plus the layout weight tolerance.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from layouts import LR, STEPS, Run, reference, train_layout
from numerics import LOSS_RTOL, layout_weight_atol

import hybridpar.parallel.fp8 as fp8_module
from hybridpar.parallel.fp8 import E5M2
from hybridpar.training.trainer import Trainer

pytestmark = pytest.mark.numerics

# every GEMM dimension a multiple of 16 at tp2 / cp2 (rule train-fp8-dims): head_dim 16, kv 2 x 16
MODEL = ("--model.dim", "64")
MOE = ("--model.family", "mixtral", "--model.n_experts", "4", "--model.experts_per_token", "2",
       "--model.moe_ffn_hidden", "32", "--model.n_kv_heads", "4")
LAYOUTS = {
    "tp2-sp": ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"],
    "pp2-1f1b": ["--parallel.pp", "2"],
    "pp2-zb-h1": ["--parallel.pp", "2", "--parallel.pipeline_schedule", "zb-h1"],
    "cp2": ["--parallel.cp", "2"],
    "ep2": ["--parallel.dp", "2", "--parallel.ep", "2"],
    "zero2": ["--parallel.dp", "2", "--parallel.zero_stage", "2"],
    "zero3": ["--parallel.dp", "2", "--parallel.zero_stage", "3"],
    "dp2-tp2-pp2": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2"],
}
# one process, other kernels or schedules of the same math (rowwise only: no scale check needed)
SINGLE = {
    "recompute-full": ["--parallel.recompute", "full"],
    "compile": ["--train.compile", "true", "--train.compile_backend", "aot_eager"],
}
ROWWISE = ("tp2-sp", "pp2-zb-h1", "cp2", "dp2-tp2-pp2", *SINGLE)
SCALES: list[tuple[str, float]] = []
_ORIGINAL = fp8_module.scale_of


def _recording_scale_of(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    s = _ORIGINAL(a, dtype)
    if SCALES is not None and not getattr(_recording_scale_of, "done", False):
        SCALES.extend((str(dtype), v) for v in s.flatten().tolist())
    return s


def record_first_step(trainer: Trainer) -> dict[str, Any]:
    """Before probe: record every FP8 scale of step 1 on this rank."""
    SCALES.clear()
    _recording_scale_of.done = False
    fp8_module.scale_of = _recording_scale_of
    step = trainer.train_step

    def first_only(n: int) -> Any:
        out = step(n)
        _recording_scale_of.done = True
        return out

    trainer.train_step = first_only
    return {}


def report_scales(trainer: Trainer) -> dict[str, Any]:
    """After probe: step 1's scales, which ranks hold the same ones (tp, cp peers), and the
    factor this layout's output gradients carry against one process's (module doc)."""
    fp8_module.scale_of = _ORIGINAL
    topo, p = trainer.topo, trainer.cfg.parallel
    return {"scales": list(SCALES), "replica": topo.tp.rank != 0 or topo.cp.rank != 0,
            "grad_factor": p.dp * p.cp}


def _family(name: str) -> tuple[str, ...]:
    return (*MODEL, *MOE) if name == "ep2" else MODEL


def _check_scales(results: list[Any], expected: Any) -> None:
    union: collections.Counter[tuple[str, float]] = collections.Counter()
    for r in results:
        if not r.extra["replica"]:
            f = r.extra["grad_factor"]  # a power of two here: output-gradient scales are 1/f of one process's
            union.update((dt, v * f if dt == str(E5M2) else v) for dt, v in r.extra["scales"])
    assert len(expected.extra["scales"]) > 0
    assert union == collections.Counter(expected.extra["scales"])


@pytest.mark.parametrize("recipe,name", [("tensorwise", n) for n in LAYOUTS] + [("rowwise", n) for n in ROWWISE])
def test_fp8_layout_trains_like_one_process(tmp_path: Any, recipe: str, name: str) -> None:
    tmp, base = str(tmp_path), _family(name)
    probes = dict(before=record_first_step, after=report_scales) if recipe == "tensorwise" else {}
    fp8 = ("--fp8.recipe", recipe)
    expected = reference(Run(tmp, (*base, *fp8), **probes))
    plain = reference(Run(tmp, base))
    results = train_layout(Run(tmp, (*base, *fp8, *{**LAYOUTS, **SINGLE}[name]), **probes), timeout=600)
    if probes:
        _check_scales(results, expected)
    assert_fp8_like_one_process(results, expected, plain)


def assert_fp8_like_one_process(results: list[Any], expected: Any, plain: Any) -> None:
    """Every rank's losses and rank 0's weights within the module doc's bound of the one-process
    FP8 run ``expected`` (``plain``: the same run unquantized, which measures the format's error)."""
    fmt = [abs(a - b) for a, b in zip(expected.losses, plain.losses, strict=True)]
    for rank, r in enumerate(results):
        assert r.losses[0] == pytest.approx(expected.losses[0], rel=LOSS_RTOL), f"rank {rank}"
        for step in range(1, STEPS):
            bound = 2 * fmt[step] + LOSS_RTOL * abs(expected.losses[step])
            assert abs(r.losses[step] - expected.losses[step]) <= bound, f"rank {rank} step {step + 1}"
    atol = layout_weight_atol(LR, STEPS)
    for k, w in results[0].state.items():
        ref = expected.state[k].double()
        allowed = 2 * float((ref - plain.state[k].double()).abs().max()) + atol
        assert float((w.double() - ref).abs().max()) <= allowed, k
