"""FP8 in the planner (``fp8.recipe``; ``hybridpar plan --fp8``): the blocks' linear GEMMs at the
GPU's FP8 rate, plus the scaling passes that quantize their operands.

Rates: the data sheets' dense FP8 tensor-core peaks (:class:`~hybridpar.planner.machine.hardware.GPUSpec`
``fp8_flops``), twice the bf16 peak on H100, H200 and B200; a GPU without FP8 tensor cores
(``fp8_flops`` 0: A100, or a CPU profile) is refused, as the trainer refuses it. A GEMM of FP8
operands reads 1 byte per operand element and writes the 2-byte output.

Scaling overhead (``parallel/fp8``): quantizing an operand of ``e`` elements reads it twice
(amax, then scale-and-cast) and writes one byte each: ``5 e`` bytes of memory traffic at
``hbm_bw``, and three kernels (amax, scale, cast). Per linear ``[m, k] @ [k, n]``: tensorwise
quantizes ``x`` and ``W`` in forward and ``dy`` once in backward (its ``dW`` reuses them);
rowwise quantizes ``x`` and ``W`` in forward, ``dy`` and ``W`` again (other axis) for ``dx``,
and ``dy`` and ``x`` again for ``dW``. The amax all-reduces under tp and cp are a few floats
each: their bytes are counted (:func:`amax_all_reduces`), their time (latency only) left out.
Experts (grouped GEMMs) and attention stay bf16.

FP8 parameter all-gather (``fp8.all_gather``, ZeRO-3 with tensorwise FP8): the FP8
linears' weights (:func:`is_fp8_weight`) cross ZeRO-3's all-gathers at 1 byte per element
instead of the parameter dtype's, plus one all-reduce of a float per weight (their amaxes) over
the ZeRO axis per gather (:func:`hybridpar.rules.fp8_gathers`; ``planner.price.traffic`` counts both, ``planner.price.dp_cost``
times the smaller gathers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hybridpar.config import ModelConfig
from hybridpar.planner.machine.hardware import GPUSpec, PlanError
from hybridpar.planner.model.layout import Layout, Workload
from hybridpar.planner.model.shapes import FP8_LINEARS, is_fp8_weight, shard_elems

__all__ = ["FP8_LINEARS", "amax_all_reduces", "fp8_gemm_deltas", "is_fp8_weight", "zero3_gather"]


def zero3_gather(add: Callable[..., None], axis: str, n: int, unit: Sequence[tuple[str, tuple[int, ...]]],
                 elem: int, times: int, fp8: bool) -> None:
    """ZeRO-3's all-gather of one unit (names and shapes), ``times`` times, into ``add`` (as
    ``planner.price.traffic`` counts): its padded shard at ``elem`` bytes per element, or with ``fp8``
    the FP8 linears' weights at 1 byte and the rest at ``elem``, each gather after an all-reduce
    of the weights' amaxes (4 bytes each; :mod:`hybridpar.parallel.zero.fp8_gather`)."""
    weights = [s for nm, s in unit if fp8 and is_fp8_weight(nm)]
    rest = [s for nm, s in unit if not (fp8 and is_fp8_weight(nm))]
    add("all_gather", axis, n, shard_elems(rest, n) * elem + shard_elems(weights, n), times)
    if weights:
        add("all_reduce", axis, n, 4 * len(weights), times)


def amax_all_reduces(add: Callable[..., None], model: ModelConfig, L: Layout, work: Workload, n_dense: int,
                     n_moe: int, m: int, gathered: bool) -> None:
    """The FP8 linears' amax all-reduces (fp32, 4 bytes per amax) in ``n_dense`` dense and ``n_moe``
    MoE layers (their attention's four linears), ``m`` micro-batches, into ``add`` (as
    ``planner.price.traffic`` counts). As :class:`hybridpar.parallel.fp8.Fp8Layout` reduces them:
    a column-parallel linear ``[N/t, K]`` over tp its ``W`` (forward) and ``dy`` (backward),
    a row-parallel one ``[N, K/t]`` its ``x`` and ``W`` (forward); every linear over cp its ``x``
    and ``dy``. Tensorwise, one scalar each (no ``W``'s when ZeRO-3 gathers it in FP8,
    ``gathered``); rowwise, vectors: column ``dy`` per token and ``W`` per input feature for
    ``dx``, row ``x`` per token and ``W`` per output feature in forward, and for ``dW`` over cp
    ``dy`` and ``x`` per feature. Full recomputation reruns the forward's, the down projection's
    too: torch's checkpoint stops after its saved operands, quantized before its GEMM."""
    if work.fp8 == "none":
        return
    h, f, q, kv = model.dim, model.ffn_hidden, model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    t, tok, n = L.tp, L.micro_batch * (work.seq_len // L.cp), n_dense + n_moe
    rerun = m if L.recompute == "full" else 0
    w = 0 if gathered else 1
    if work.fp8 == "tensorwise":
        linears, rows = 7 * n_dense + 4 * n_moe, 2 * n_dense + n_moe
        add("all_reduce", "tp", t, 4 * (1 + w) * linears, m)
        add("all_reduce", "cp", L.cp, 4 * 2 * linears, m)
        add("all_reduce", "tp", t, 4 * (w * linears + rows), rerun)  # each W, and the row-parallel x
        add("all_reduce", "cp", L.cp, 4 * linears, rerun)
        return
    column = [(q, h), (kv, h), (kv, h)] * n + [(f, h), (f, h)] * n_dense  # (N, K) of the whole weight
    row = [(h, q)] * n + [(h, f)] * n_dense
    add("all_reduce", "tp", t, 4 * sum(tok + k for _, k in column) + 4 * sum(tok + nn for nn, _ in row), m)
    add("all_reduce", "cp", L.cp, 4 * sum(nn // t + k for nn, k in column) + 4 * sum(nn + k // t for nn, k in row), m)
    add("all_reduce", "tp", t, 4 * (tok + h) * len(row), rerun)  # the rerun forward's row-parallel x, W


_QUANT_BYTES = 5  # per element: read for the amax, read again, write one FP8 byte
_QUANT_KERNELS = 3


def _quantize_time(elements: float, gpu: GPUSpec) -> float:
    return _QUANT_BYTES * elements / gpu.hbm_bw + _QUANT_KERNELS * gpu.launch_overhead


def _fp8_gemm(m: float, n: float, k: float, gpu: GPUSpec, eff: float) -> float:
    """Seconds of one FP8 GEMM: the roofline at the FP8 peak (``eff``: the bf16 GEMM's achieved
    fraction of peak for this shape, carried over), 1-byte operands, a 2-byte output."""
    flops = 2.0 * m * n * k
    mem = (m * k + k * n + 2 * m * n) / gpu.hbm_bw
    return max(flops / (gpu.fp8_flops * eff), mem) + gpu.launch_overhead


def fp8_gemm_deltas(gemms: Sequence[tuple[float, float, float]], gpu: GPUSpec, recipe: str,
                    bf16_time: object) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds FP8 adds to one block's dense linear
    ``gemms`` (``(m, n, k)`` each, as ``planner.price.cost`` prices them with ``bf16_time(m, n, k)``):
    the FP8 GEMMs and their scaling passes minus the bf16 GEMMs they replace (negative: a gain)."""
    if gpu.fp8_flops <= 0:
        raise PlanError(f"fp8.recipe = {recipe!r}: {gpu.name} has no FP8 tensor cores in its spec (fp8_flops = 0); "
                        "plan without --fp8, or give the GPU's fp8_flops in a TOML spec")
    fwd = bwd_in = bwd_w = 0.0
    for m, n, k in gemms:
        times = (bf16_time(m, n, k), bf16_time(m, k, n), bf16_time(k, n, m))  # type: ignore[operator]
        shapes = ((m, n, k), (m, k, n), (k, n, m))
        # the bf16 time's efficiency at this shape, so tile quantisation carries over
        fp8 = [_fp8_gemm(*s, gpu, min(1.0, 2.0 * s[0] * s[1] * s[2] / ((t - gpu.launch_overhead) * gpu.bf16_flops)))
               for s, t in zip(shapes, times, strict=True)]
        x, w, dy = m * k, n * k, m * n
        if recipe == "tensorwise":
            scale = (_quantize_time(x + w, gpu), _quantize_time(dy, gpu), 0.0)
        else:
            scale = (_quantize_time(x + w, gpu), _quantize_time(dy + w, gpu), _quantize_time(dy + x, gpu))
        fwd += fp8[0] + scale[0] - times[0]
        bwd_in += fp8[1] + scale[1] - times[1]
        bwd_w += fp8[2] + scale[2] - times[2]
    return fwd, bwd_in, bwd_w
