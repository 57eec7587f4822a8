"""FP8 linear layers (``parallel/fp8``): each GEMM against float64, and against bf16.

**Exact up to accumulation.** With power-of-two scales, quantizing is one rounding onto the FP8
grid and dequantizing is exact, so a GEMM of quantized operands equals the float64 product of
the dequantized operands (recomputed here independently: float64 amax, ``2^floor(log2(fmax /
amax))``) up to ``_scaled_mm``'s fp32 accumulation: ``|got - ref| <= gamma_K (|A| |B|) + u_out
|ref|`` elementwise (Higham's dot-product bound, ``gamma_K = K u / (1 - K u)``, ``u = 2^-24``;
``u_out`` the output's rounding, 2^-24 for fp32).

**The format's error against bf16.** An FP8 element ``t`` with scale ``s`` is off by at most
``u_f |t| + eta_f / s``: e4m3 ``u = 2^-4`` (3 mantissa bits), ``eta = 2^-10`` (half its smallest
subnormal, 2^-9); e5m2 ``u = 2^-3``, ``eta = 2^-17``. A product of two such operands is then
off by ``sum_k e_a |b| + |a| e_b + e_a e_b`` plus accumulation; a bf16 linear (autocast) by
``2 u_bf16 |A||B| + gamma_K |A||B| + u_bf16 |y|`` (``u_bf16 = 2^-8``). So
``|y_fp8 - y_bf16|`` is at most the sum of the two bounds, elementwise, for the output and
both gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridpar.parallel.fp8 as fp8_module
from hybridpar import compat
from hybridpar.distributed.comm import Comm
from hybridpar.distributed.mesh import Axis
from hybridpar.parallel.fp8 import E4M3, E5M2, Fp8Layout, to_fp8
from hybridpar.parallel.pipeline.wsplit import Deferred, WeightGradSplit
from hybridpar.parallel.tensor import ColumnParallelLinear, RowParallelLinear

pytestmark = pytest.mark.numerics

U32, U_BF16 = 2.0**-24, 2.0**-8
FORMAT = {E4M3: (2.0**-4, 2.0**-10), E5M2: (2.0**-3, 2.0**-17)}
M, K, N = 16, 32, 48
# per GEMM: (left operand, its amax dim, dtype), (right operand, dim, dtype); dims of x [M, K],
# w [N, K], dy [M, N] as stored (None: the whole tensor)
RECIPES = {
    "tensorwise": {"y": ((None, E4M3), (None, E4M3)), "dx": ((None, E5M2), (None, E4M3)),
                   "dw": ((None, E5M2), (None, E4M3))},
    "rowwise": {"y": ((1, E4M3), (1, E4M3)), "dx": ((1, E4M3), (0, E4M3)), "dw": ((0, E4M3), (0, E4M3))},
}


def _axis() -> Axis:
    return Axis("tp", 1, 0, (0,), None, Comm())


def _make(kind: str, recipe: str, w: torch.Tensor, b: torch.Tensor | None) -> nn.Module:
    if kind == "linear":
        layer = nn.Linear(K, N, bias=b is not None)
        with torch.no_grad():
            layer.weight.copy_(w)
            if b is not None:
                layer.bias.copy_(b)
        to_fp8(layer, Fp8Layout(recipe))
        return layer
    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    layer = cls.from_full(w, _axis(), bias=b)
    layer.fp8 = Fp8Layout(recipe)
    return layer


def _scale(t: torch.Tensor, dim: int | None, dtype: torch.dtype) -> torch.Tensor:
    a = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    return 2.0 ** torch.floor(torch.log2(torch.finfo(dtype).max / a.clamp(min=1e-12)))


def _dequantized(t: torch.Tensor, dim: int | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``t`` through FP8 and back (exact: power-of-two scale), and its per-element error bound."""
    t = t.double()
    s = _scale(t, dim, dtype)
    fmax = torch.finfo(dtype).max
    d = (t * s).clamp(-fmax, fmax).float().to(dtype).double() / s
    u, eta = FORMAT[dtype]
    return d, u * t.abs() + eta / s


def _gemms(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each GEMM's (left, right) operands as stored, right ones already in ``left @ right`` form."""
    return {"y": (x, w), "dx": (dy, w), "dw": (dy, x)}


def _as_product(name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return {"y": (a, b.t()), "dx": (a, b), "dw": (a.t(), b)}[name]


def _run(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, autocast: bool = False) -> dict[str, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x.view(2, M // 2, K))
    y.backward(dy.view_as(y).to(y.dtype))
    out = {"y": y.detach().reshape(M, N).double(), "dx": x.grad.double(), "dw": layer.weight.grad.double()}
    if getattr(layer, "bias", None) is not None:
        out["y"] = out["y"] - layer.bias.detach().double()
    return out


def _data(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 1, K)  # features over four decades
    return x, torch.randn(N, K, generator=g) * 0.1, torch.randn(M, N, generator=g) * 1e-3, torch.randn(N, generator=g)


@pytest.mark.parametrize("kernel", [True, False], ids=["scaled_mm", "cpu-fp32-gemm"])
@pytest.mark.parametrize("kind", ["linear", "column", "row"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_gemms_equal_float64_of_quantized_operands(kind: str, recipe: str, kernel: bool, monkeypatch: Any) -> None:
    """Both CPU paths of ``compat.scaled_mm``: torch's ``_scaled_mm`` kernel, and the fp32 GEMM of
    the dequantized operands the CPU runs by default."""
    monkeypatch.setattr(compat, "CPU_SCALED_MM_KERNEL", kernel)
    x, w, dy, b = _data(0)
    got = _run(_make(kind, recipe, w, b if kind != "row" else None), x, dy)  # row: bias after the tp sum
    for name, (left, right) in _gemms(x, w, dy).items():
        (da, ea), (db, eb) = (_dequantized(t, dim, dt) for t, (dim, dt) in zip((left, right), RECIPES[recipe][name], strict=True))
        a, bq = _as_product(name, da, db)
        ref = a @ bq
        k = a.shape[1]
        bound = k * U32 / (1 - k * U32) * (a.abs() @ bq.abs()) + U32 * ref.abs()
        if name == "y" and kind != "row":  # the bias is added in fp32 after the GEMM: one more rounding
            bound = bound + 2 * U32 * (ref.abs() + b.double().abs())
        assert ((got[name] - ref).abs() <= bound).all(), name
        # and FP8 did happen: the unquantized product is further away than accumulation explains
        a0, b0 = _as_product(name, left.double(), right.double())
        assert ((got[name] - a0 @ b0).abs() > bound).any(), name


@pytest.mark.parametrize("kind", ["linear", "column", "row"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_within_format_error_of_bf16(kind: str, recipe: str) -> None:
    x, w, dy, _ = _data(1)
    fp8 = _run(_make(kind, recipe, w, None), x, dy)
    plain = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        plain.weight.copy_(w)
    bf16 = _run(plain, x, dy, autocast=True)
    for name, (left, right) in _gemms(x, w, dy).items():
        (_, ea), (_, eb) = (_dequantized(t, dim, dt) for t, (dim, dt) in zip((left, right), RECIPES[recipe][name], strict=True))
        a, bm = _as_product(name, left.double().abs(), right.double().abs())
        ea, eb = _as_product(name, ea, eb)
        k = a.shape[1]
        gamma = k * U32 / (1 - k * U32)
        exact = (lambda p, q: p @ q)(*_as_product(name, left.double(), right.double()))
        fp8_bound = ea @ bm + a @ eb + ea @ eb + gamma * (a @ bm) * (1 + 2 * 2.0**-3) + U32 * exact.abs()
        bf16_bound = (2 * U_BF16 + U_BF16**2 + gamma) * (a @ bm) + U_BF16 * (exact.abs() + (a @ bm) * 2 * U_BF16)
        assert ((fp8[name] - exact).abs() <= fp8_bound).all(), name
        assert ((bf16[name] - exact).abs() <= bf16_bound).all(), name
        assert ((fp8[name] - bf16[name]).abs() <= fp8_bound + bf16_bound).all(), name


def test_fp8_under_autocast_keeps_dtypes() -> None:
    """bf16 out under autocast, the input's gradient in its dtype, the master weight's in fp32."""
    x, w, dy, b = _data(2)
    layer = _make("linear", "rowwise", w, b)
    xx = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(xx)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert xx.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_weight_split_runs_each_gemm_once(recipe: str, monkeypatch: Any) -> None:
    """The zero-bubble split: B runs only the input-gradient GEMM, W only the weight-gradient
    GEMM, and together they give plain backward's gradients bit for bit."""
    x, w, dy, _ = _data(3)
    calls: list[str] = []
    real = fp8_module.scaled_mm

    def counting(*args: Any) -> torch.Tensor:
        calls.append("mm")
        return real(*args)

    monkeypatch.setattr(fp8_module, "scaled_mm", counting)
    plain = _run(_make("linear", recipe, w, None), x, dy)
    layer = _make("linear", recipe, w, None)
    split, record = WeightGradSplit([layer]), Deferred()
    xx = x.clone().requires_grad_()
    calls.clear()
    with split.forward(record):
        y = layer(xx)
    with split.backward():
        y.backward(dy)
    assert (len(calls), layer.weight.grad) == (2, None)  # forward + B's input gradient
    record.weight_grads()
    assert len(calls) == 3
    assert torch.equal(xx.grad.double(), plain["dx"]) and torch.equal(layer.weight.grad.double(), plain["dw"])
    split.remove()


def test_plain_linear_forward_is_untouched() -> None:
    x, w, _, b = _data(4)
    layer = ColumnParallelLinear.from_full(w, _axis(), bias=b)
    assert torch.equal(layer(x), F.linear(x, w, b))
