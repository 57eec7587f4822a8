"""FP8 linear layers: the forward and both backward GEMMs with FP8 operands and dynamic scaling.

``y = x W^T`` (``x [M, K]`` tokens by input features, ``W [N, K]``) runs as three
``torch._scaled_mm`` GEMMs (:func:`hybridpar.compat.scaled_mm`, accumulated in fp32):

* forward ``y = x W^T``;  input gradient ``dx = dy W``;  weight gradient ``dW = dy^T x``.

Each operand is quantized from its high-precision value ``t`` as ``q = fp8(clamp(t * s))`` with
a *scale* ``s`` from the operand's absolute maximum, ``s = 2^floor(log2(fmax / amax))`` (a power
of two, as torchao's rowwise recipe rounds it: ``t * s`` and the dequantization ``q / s`` are then
exact, so quantizing is one rounding to the FP8 grid and nothing else). Two recipes, as
torchtitan/torchao's ``Float8Linear``:

* ``tensorwise``: one amax per tensor; ``x`` and ``W`` in e4m3 (3 mantissa bits, max 448), the
  output gradient ``dy`` in e5m2 (2 mantissa bits, max 57344: gradients need range more than
  precision). The forward's quantized ``x`` and ``W`` are reused by the backward.
* ``rowwise``: one amax per row of the left operand and per column of the right one, along the
  GEMM's reduction dimension: forward ``x`` per token and ``W`` per output feature; ``dx``: ``dy``
  per token and ``W`` per input feature; ``dW``: ``dy`` and ``x`` per feature over the tokens.
  All operands e4m3 (torchao's rowwise recipe; CUDA's rowwise kernels take e4m3 only).

Master weights stay as they are (fp32); the weight gradient is returned in the weight's dtype
(an fp32 GEMM output), the input gradient and the output in the activation dtype (bf16 under
autocast). Bias, if any, is added after the GEMM in the output dtype.

**Every layout computes the scales of one process.** An amax over a dimension that this rank
holds only part of is max-reduced over the axes that split it (:class:`Fp8Layout`: ``tokens``
split ``M``, ``out_axes`` split ``N``, ``in_axes`` split ``K``); max is exact and associative, so
the scales, and hence every quantized element, equal the single-process ones, and only the
GEMMs' fp32 accumulation order differs (a partial sum over tp). Column-parallel (``N`` over tp):
tensorwise reduces the amax of ``W`` and of ``dy`` over tp; rowwise reduces ``dy``'s per-token
and ``W``'s per-input-feature amax (the ``dx`` GEMM reduces over ``N``) and nothing in forward or
``dW`` (their reductions run over the whole ``K`` or ``M`` held here). Row-parallel (``K`` over
tp): tensorwise reduces ``x`` and ``W``; rowwise only the forward's per-token and per-output-
feature amax (over ``K``). Context parallelism splits ``M``: tensorwise ``x`` and ``dy`` and
rowwise ``dW``'s per-feature amax are reduced over cp. Sequence parallelism adds nothing (the
linears see whole sequences after its gather). Each is one all-reduce of a scalar or a vector
(``M``, ``N`` or ``K`` floats).

The zero-bubble W split (``parallel/pipeline/wsplit``) sees :func:`fp8_linear` as it sees
``F.linear`` (a torch function), and the backward asks the engine which of ``x`` and ``W`` it
needs (:func:`hybridpar.compat.will_engine_execute`), so B runs only the ``dx`` GEMM and W only
the ``dW`` GEMM, in FP8 too.

**FP8 parameter all-gather** (``fp8.all_gather``, ZeRO-3, tensorwise): ZeRO-3 shards
``W`` by rows (dim 0, ``N``) and gathers it before each use. :func:`shard_weight_scales` computes
each weight's tensorwise scale from its shard (``max |W|`` over the local rows, max-reduced over
the ZeRO axis and the weight's tp axes: the amax of the whole weight, exactly), the unit
gathers ``quantize(shard, scale)`` (1 byte per element), and :func:`set_gathered` hands the
gathered FP8 weight and its scale to the linear, which uses them as its forward's (and, saved,
its backward's) ``W`` operand instead of quantizing ``W``. Quantizing is elementwise, so the
gathered FP8 weight equals the one this module quantizes from the whole ``W``: the run is
bitwise the run without the FP8 gather. Rowwise is not offered: its forward scales ``W`` per
output feature (a row, along ``K``: local to the shard owner), but its ``dx`` GEMM scales ``W``
per *input* feature (a column, along ``N``: across every ZeRO shard), which a row-scaled FP8
copy cannot give without a second rounding, so the backward would need the high-precision
weight gathered too (torchao likewise gathers FP8 for tensorwise scaling only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.overrides import handle_torch_function, has_torch_function_variadic

from hybridpar.compat import scaled_mm, will_engine_execute
from hybridpar.distributed.mesh import Axis

__all__ = ["E4M3", "E5M2", "FP8_RECIPES", "Fp8Layout", "Fp8Linear", "Fp8Recipe", "amax", "fp8_linear", "quantize",
           "gathered_weight", "scale_of", "set_gathered", "shard_weight_scales", "to_fp8"]

Fp8Recipe = Literal["tensorwise", "rowwise"]
FP8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
#: the smallest amax a scale is taken from (torchao's EPS): an all-zero tensor gets a finite scale
AMAX_EPS = 1e-12


@dataclass(frozen=True)
class Fp8Layout:
    """How one linear's FP8 GEMMs are scaled: the recipe, and the mesh axes that split each of
    its dimensions on this rank (amaxes over a split dimension are max-reduced over them)."""

    recipe: Fp8Recipe
    tokens: tuple[Axis, ...] = ()  # split M (context parallelism)
    out_axes: tuple[Axis, ...] = ()  # split N (a column-parallel weight's rows)
    in_axes: tuple[Axis, ...] = ()  # split K (a row-parallel weight's columns)


def amax(t: Tensor, dim: int | None, axes: tuple[Axis, ...]) -> Tensor:
    """``max |t|`` in fp32 over all of ``t`` (``dim`` None, a 0-dim tensor) or along ``dim``
    (kept, size 1), max-reduced over ``axes`` (the axes splitting the reduced dimensions)."""
    a = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    a = a.float()
    for axis in axes:
        if axis.size > 1:
            a = axis.comm.all_reduce(a.contiguous(), axis, op="max")
    return a


def scale_of(a: Tensor, dtype: torch.dtype) -> Tensor:
    """The power-of-two quantization scale for amax ``a``: the largest ``2^e <= fmax / a``
    (``frexp`` is exact, so the scale never depends on a log's rounding)."""
    s = torch.finfo(dtype).max / a.clamp(min=AMAX_EPS)
    _, exponent = torch.frexp(s)
    return torch.ldexp(torch.ones_like(s), exponent - 1)


def quantize(t: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``fp8(clamp(t * scale, +-fmax))``: one round-to-nearest-even onto the FP8 grid."""
    fmax = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype)


def shard_weight_scales(shards: list[Tensor], layouts: list[Fp8Layout], zero: Axis) -> Tensor:
    """The tensorwise e4m3 scale of each whole weight from this rank's rows of it (``shards``;
    possibly none): the local amaxes, max-reduced as one vector over the ZeRO axis ``zero`` and
    over each weight's tp axes (``out_axes + in_axes``), so every rank holds the scales one
    process computes from the whole weights."""
    if not shards:
        return torch.zeros(0)
    a = torch.stack([s.abs().amax().float() if s.numel() else s.new_zeros((), dtype=torch.float32)
                     for s in shards])
    if zero.size > 1:
        a = zero.comm.all_reduce(a, zero, op="max")
    by_axes: dict[tuple[Axis, ...], list[int]] = {}
    for i, layout in enumerate(layouts):
        by_axes.setdefault(tuple(x for x in layout.out_axes + layout.in_axes if x.size > 1), []).append(i)
    for axes, idx in by_axes.items():
        for axis in axes:
            a[idx] = axis.comm.all_reduce(a[idx].contiguous(), axis, op="max")
    return scale_of(a, E4M3)


def set_gathered(weight: Tensor, q: Tensor | None, scale: Tensor | None = None) -> None:
    """Give ``weight`` (a gathered parameter) its FP8 copy ``q`` and tensorwise ``scale``, which
    the linear then uses instead of quantizing it; ``q`` None: take them away (resharded)."""
    weight.__dict__["_fp8_gathered"] = None if q is None else (q, scale)


def gathered_weight(weight: Tensor) -> tuple[Tensor, Tensor] | None:
    """``weight``'s FP8 copy and scale from :func:`set_gathered`, or None."""
    return weight.__dict__.get("_fp8_gathered")


def _colmajor(t: Tensor) -> Tensor:
    """``t`` with the same values, stored column-major (``_scaled_mm``'s right operand on CUDA)."""
    return t.t().contiguous().t()


def _operand(t: Tensor, dim: int | None, axes: tuple[Axis, ...], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``t`` quantized with its scale (amax along ``dim``, reduced over ``axes``): (q, scale)."""
    s = scale_of(amax(t, dim, axes), dtype)
    return quantize(t, s, dtype), s


def _will(ctx: Any, i: int) -> bool:
    """Whether the running backward needs the gradient of the Function's ``i``-th input."""
    node = ctx.next_functions[i][0]
    return ctx.needs_input_grad[i] and node is not None and will_engine_execute(node)


class _Tag(torch.autograd.Function):
    """Identity, as its own autograd node: :func:`_will` may ask the engine about a non-leaf
    node only, so each input of the FP8 GEMM passes through one (a view, no copy)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor) -> Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


class _Fp8Matmul(torch.autograd.Function):
    """``x [M, K] @ W[N, K]^T`` with the three GEMMs in FP8 (module doc)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, layout: Fp8Layout, out_dtype: torch.dtype,
                gathered: tuple[Tensor, Tensor] | None) -> Tensor:
        ctx.layout, ctx.x_dtype, ctx.w_dtype = layout, x.dtype, w.dtype
        if layout.recipe == "tensorwise":
            xq, sx = _operand(x, None, layout.tokens + layout.in_axes, E4M3)
            wq, sw = gathered or _operand(w, None, layout.out_axes + layout.in_axes, E4M3)
            ctx.save_for_backward(xq, wq, sx, sw)
            return scaled_mm(xq, wq.t(), sx.reciprocal(), sw.reciprocal(), out_dtype)
        if gathered is not None:
            raise ValueError("an FP8-gathered weight carries a tensorwise scale; rowwise quantizes the weight itself")
        xq, sx = _operand(x, 1, layout.in_axes, E4M3)
        wq, sw = _operand(w, 1, layout.in_axes, E4M3)
        ctx.save_for_backward(x, w)
        return scaled_mm(xq, wq.t(), sx.reciprocal(), sw.reciprocal().reshape(1, -1), out_dtype)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        layout: Fp8Layout = ctx.layout
        need_x, need_w = _will(ctx, 0), _will(ctx, 1)
        dy = dy.contiguous()
        if layout.recipe == "tensorwise":
            xq, wq, sx, sw = ctx.saved_tensors
            # the W split's B and W each run this backward; the one quantized dy serves both
            gq, sg = ctx.__dict__.pop("dy_q", None) or _operand(dy, None, layout.tokens + layout.out_axes, E5M2)
            if need_x and not need_w:
                ctx.dy_q = gq, sg
            dx = scaled_mm(gq, _colmajor(wq), sg.reciprocal(), sw.reciprocal(), ctx.x_dtype) if need_x else None
            dw = (scaled_mm(gq.t().contiguous(), _colmajor(xq), sg.reciprocal(), sx.reciprocal(), ctx.w_dtype)
                  if need_w else None)
            return dx, dw, None, None, None
        x, w = ctx.saved_tensors
        dx = dw = None
        if need_x:
            gq, sg = _operand(dy, 1, layout.out_axes, E4M3)  # per token, over N
            wq, sw = _operand(w, 0, layout.out_axes, E4M3)  # per input feature, over N
            dx = scaled_mm(gq, _colmajor(wq), sg.reciprocal(), sw.reciprocal(), ctx.x_dtype)
        if need_w:
            gq, sg = _operand(dy, 0, layout.tokens, E4M3)  # per output feature, over M
            xq, sx = _operand(x, 0, layout.tokens, E4M3)  # per input feature, over M
            dw = scaled_mm(gq.t().contiguous(), _colmajor(xq), sg.reciprocal().reshape(-1, 1), sx.reciprocal(), w.dtype)
        return dx, dw, None, None, None


def _fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, layout: Fp8Layout) -> Tensor:
    if x.dtype in (torch.float16, torch.float64):
        raise ValueError(f"FP8 linear layers take fp32 or bf16 activations, not {x.dtype}")
    out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    with torch.autocast(x.device.type, enabled=False):
        y = _Fp8Matmul.apply(_Tag.apply(x2), _Tag.apply(weight), layout, out_dtype, gathered_weight(weight))
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias.to(y.dtype)


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, layout: Fp8Layout) -> Tensor:
    """``F.linear(x, weight, bias)`` with FP8 GEMMs scaled as ``layout`` says (module doc).

    A torch function (``TorchFunctionMode``s see it, as the W split does); outside compiled
    graphs (``train.compile`` compiles the code between linears), as the other collectives'
    callers are."""
    if has_torch_function_variadic(x, weight, bias):
        return handle_torch_function(fp8_linear, (x, weight, bias), x, weight, bias, layout)
    return _eager_fp8_linear(x, weight, bias, layout)


_eager_fp8_linear = _fp8_linear  # wrapped by _keep_outside_graphs


def _keep_outside_graphs() -> None:
    """Wrap the GEMMs of :func:`fp8_linear` in ``torch.compiler.disable`` once, when the first
    linear becomes FP8 (:func:`to_fp8`, before anything is compiled), not at import: applying it
    imports torch._dynamo, 3-4 s that a process which only imports this module (``hybridpar
    plan``) does not need to pay (as :class:`~hybridpar.distributed.comm.Comm` does for the
    collectives). :func:`fp8_linear` itself stays the same object (the W split looks for it)."""
    global _eager_fp8_linear
    if _eager_fp8_linear is _fp8_linear:
        _eager_fp8_linear = torch.compiler.disable(_fp8_linear, recursive=True)


class Fp8Capable:
    """A linear layer whose GEMMs may run in FP8: :attr:`fp8`, its layout (None: they do not).
    The column- and row-parallel linears and :class:`Fp8Linear` are; ZeRO-3's FP8 all-gather
    asks a parameter's owner through it (``isinstance``, no attribute looked up by name)."""

    fp8: Fp8Layout | None = None


class Fp8Linear(Fp8Capable, nn.Linear):
    """``nn.Linear`` whose GEMMs run in FP8 (:func:`fp8_linear` with ``fp8``): what an
    ``nn.Linear`` of a block becomes under ``fp8.recipe`` (:func:`to_fp8`), same parameters."""

    fp8: Fp8Layout

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.bias, self.fp8)


def to_fp8(layer: nn.Linear, layout: Fp8Layout) -> None:
    """Make the plain ``layer`` an :class:`Fp8Linear` in place (its parameters, hooks and
    place in the model unchanged)."""
    _keep_outside_graphs()
    layer.__class__ = Fp8Linear
    layer.fp8 = layout
