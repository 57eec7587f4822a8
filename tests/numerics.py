"""What is bit-exact and what is not, and comparisons in units in the last place (ulps).

The rule the tests follow:

* **Exact** (``torch.equal`` / ``rtol=atol=0``): a copy, a save and reload, a resume with the
  same layout (same shapes, same kernels), and one IEEE operation on the same operands:
  ``a + b == b + a``, so a sum of *two* terms (a dp=2 all-reduce or reduce-scatter) is the same
  in any order. Sums of integers below 2**24 are exact in any order too.
* **Not exact**: the same elementwise formula run on another shape, shard or layout. ATen
  vectorises an elementwise loop in blocks of ``2 * Vec::size()`` lanes (16 floats with AVX2,
  32 with AVX-512, the ``default`` build's generic vectors in between) and finishes the remainder
  with a scalar loop; the vector and the scalar loop may contract ``a * b + c`` into one FMA
  differently (``lerp``, ``addcmul``, ``addcdiv``, the three ops of Adam that have one), and
  SLEEF and libm transcendentals differ. A shard of a tensor puts an element at another lane
  position than the whole tensor does, so the same element can take the other path, and which
  path depends on ``ATEN_CPU_CAPABILITY``. Each such op then differs by at most one rounding,
  1 ulp of its result. Sums of more than two terms in another order are not exact either
  (``(a + b) + c != a + (b + c)``); their error is relative to the terms, not to the sum, so
  under cancellation it has no ulp bound in the result: those tests keep absolute tolerances.

:func:`assert_close_ulps` checks the second kind with a tolerance counted in roundings.

Layouts against one process (``layouts.assert_trains_like``): a whole training run sums in other
orders everywhere, so it is held to :data:`LOSS_RTOL` per-step losses and, for weights,
:func:`layout_weight_atol`: an absolute 1% of lr x steps. Why that weight tolerance: Adam divides
by sqrt(v), so an entry whose gradient is pure rounding noise (different summation order across
layouts) still moves by up to lr per step; any real layout bug moves weights by far more (the
per-tensor gradients agree to 1e-6, test_tensor_parallel.py).

**The fused AdamW kernel** (``fused=True``, what ZeRO runs by default; torch 2.13's
``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``) is exact in one more case, its first step
from fresh state, on any shard of a tensor and under every ``ATEN_CPU_CAPABILITY``:

* Each tensor is cut into 64-byte units (16 floats) that threads take whole, and each piece runs
  a vector body (``Vec::size()`` = 8 floats under ``default`` and AVX2, 16 under AVX-512, all
  dividing 16) and then a scalar tail. So an element runs the tail iff it is among the tensor's
  last ``numel % Vec::size()`` elements, whatever the thread count; a shard moves elements
  into or out of that tail.
* Body and tail apply the same operations in the same order (the decay ``p * (1 - lr*wd)``,
  ``sqrt(v) / sqrt(bc2) + eps``, ``p - step * m / denom``); only two may round differently: the
  lerp ``m + c1*(g - m)`` and ``v*b2 + c2*g*g``, where one path may fuse a product and the sum
  into one FMA and the other round twice (the body writes ``vec::fmadd``; the compiler may
  contract the rest). At step 1 both have a zero addend (``m = v = 0``), and an FMA with a zero
  addend rounds exactly as the product does: the two paths agree bit for bit, and every later
  op then sees equal operands. Measured: 0 differing elements over every cut tried, under all
  three capabilities (``tests/test_optimizer_impl.py``).
* From step 2 on, a tail element's ``m`` and ``v`` may differ by one such rounding (seen in
  ``v``, under 1 ulp, under AVX2 and AVX-512; never under ``default``, which is built without
  FMA). Those feed the same ops ADAMW_STEP_ULPS counts, so a step stays within it.

So where the single-process side runs the same fused kernel, the first step's update of a shard
needs no tolerance of its own (only the clipping coefficient's, CLIP_ULPS); later steps keep
ADAMW_STEP_ULPS. The fused and the foreach / for-loop kernels are different code (their own
lerp, their own contraction), so they may round any op apart: compare them with ADAMW_STEP_ULPS.
"""

from __future__ import annotations

import math

import torch

# One torch.optim.AdamW step, per element, when two kernels may round each op differently:
#   p *= 1 - lr*wd (1 rounding); m.lerp_(g, 1 - b1) (2); v *= b2 (1); v.addcmul_(g, g, 1 - b2)
#   (3); sqrt(v) (1); / sqrt(bias_correction2) (1); + eps (1); p.addcdiv_(m, denom, -step) (3).
# Two are relative to |p| (the decay and the final add); the other 11 reach p through the update
# term, whose size Adam bounds: |m_hat| / sqrt(v_hat) <= 1 at step 1 and < 1.17 for betas
# (0.9, 0.95) at any step (Cauchy-Schwarz over the moving averages), so |update| < 1.17 lr.
# One step's results then differ by at most eps * (2 |p| + 11 * 1.17 lr) < 13 eps (|p| + lr);
# 16 leaves room for the products inside lerp / addcmul, rounded relative to their operands.
ADAMW_STEP_ULPS = 16

# Clipping multiplies every gradient by max_norm / norm, and a sharded optimizer sums the
# squares over other pieces in another order. A sum of squares does not cancel: its relative
# error is ~log2(n) eps for torch's cascade sums (n <= 2**11 elements per tensor, <= 2**5
# tensors in these tests): 16 eps in norm**2, 8 in the norm, 9 in the coefficient. At step 1
# Adam's update is scale-free in g (g / (|g| + eps)); later it moves by at most 2x the relative
# change of g. So clipping adds at most 2 * 9 ulps of lr to a step.
CLIP_ULPS = 18

# Per-step losses of a layout against one process, relative.
LOSS_RTOL = 1e-5


def layout_weight_atol(lr: float, steps: int) -> float:
    """Absolute tolerance of a layout's weights after ``steps`` Adam steps at ``lr``: 1% of
    ``lr * steps`` (module docstring: noise-gradient entries move by up to lr per step)."""
    return 0.01 * lr * steps


def adam_step_bound(step: int, beta1: float = 0.9, beta2: float = 0.95) -> float:
    """The most one bias-corrected Adam step can move a weight, in units of lr, for ANY gradient
    sequence (the trainer's betas by default). Cauchy-Schwarz on m_t = (1-b1) sum b1^(t-i) g_i
    against v_t = (1-b2) sum b2^(t-i) g_i^2 gives |m_t| <= (1-b1) sqrt(sum_k (b1^2/b2)^k)
    sqrt(v_t / (1-b2)); bias correction multiplies |m|/sqrt(v) by sqrt(1-b2^t) / (1-b1^t);
    eps only shrinks the step. (Step 1: exactly 1.)"""
    gamma = beta1 * beta1 / beta2
    return ((1 - beta1) / (1 - beta1**step) * math.sqrt((1 - beta2**step) / (1 - beta2))
            * math.sqrt(sum(gamma**k for k in range(step))))


def adam_noise_cap(lr: float, steps: int) -> float:
    """How far apart two runs can take ONE weight under Adam whatever their gradients (two
    updates of opposite sign each step): where a weight's gradient is pure rounding noise its
    layouts may really differ this much, so no layout tolerance below it is provable for it."""
    return 2 * lr * sum(adam_step_bound(t) for t in range(1, steps + 1))


def weight_outliers(numel: int) -> int:
    """How many entries of a tensor may exceed :func:`layout_weight_atol` (but never
    :func:`adam_noise_cap`): those whose gradient is rounding noise, which Adam moves by up to
    lr a step in a direction set by that noise. One in a thousand, at least one. A layout bug (a
    wrong shard, a missing or doubled reduction) moves whole rows, columns or tensors: far more
    entries than that, so the check still sees it."""
    return max(1, numel // 1000)


def eps_of(dtype: torch.dtype) -> float:
    """Machine epsilon of a floating dtype: 1 ulp of a value in [1, 2)."""
    return torch.finfo(dtype).eps


def ulps_apart(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> torch.Tensor:
    """``|actual - expected|`` in units of ``eps * (|expected| + floor)``, elementwise (float64)."""
    a, e = actual.detach().double(), expected.detach().double()
    scale = eps_of(expected.dtype) * (e.abs() + floor)
    diff = (a - e).abs()
    out = diff / scale.clamp_min(torch.finfo(torch.float64).tiny)
    return torch.where(diff == 0, torch.zeros_like(out), out)


def assert_close_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: float, *, floor: float = 0.0,
                      msg: object = "") -> None:
    """Assert ``|actual - expected| <= ulps * eps(dtype) * (|expected| + floor)`` elementwise.

    ``ulps`` counts the roundings in which the two computations may differ (derive it; do not
    guess it). ``floor`` is the magnitude of the smallest quantity that was added into the
    value (for an Adam-trained weight: the per-step update bound, ``lr``): rounding errors of
    an update are relative to the update, not to a weight that happens to be near zero.
    Shapes and dtypes must match; non-finite values must match exactly.
    """
    assert actual.shape == expected.shape, (msg, actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (msg, actual.dtype, expected.dtype)
    finite = torch.isfinite(expected)
    if not bool(finite.all()):
        assert torch.equal(actual[~finite], expected[~finite]), (msg, "non-finite entries differ")
        actual, expected = actual[finite], expected[finite]
    apart = ulps_apart(actual, expected, floor)
    bad = apart > ulps
    if bool(bad.any()):
        worst = int(apart.argmax())
        raise AssertionError(
            f"{msg}: {int(bad.sum())} / {apart.numel()} elements more than {ulps} ulps apart "
            f"(scale eps * (|expected| + {floor:g})); worst {float(apart.flatten()[worst]):.1f} ulps: "
            f"{float(actual.flatten()[worst])!r} vs {float(expected.flatten()[worst])!r}")
