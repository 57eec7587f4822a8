"""The rules of FP8 training (``fp8.recipe``): what the recipe composes with and the GEMM
shapes FP8 kernels take.

The device rule (a GPU without FP8 kernels) needs the device, which a config does not know:
:func:`fp8_device_error` is asked by the engine's build with the device it got, before the
first step (``training/features/fp8.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridpar.rules.base import rule

if TYPE_CHECKING:
    from hybridpar.config import Config

#: fp8.recipe: the scaling recipes (parallel/fp8.py), and "none"
FP8_MODES = ("none", "tensorwise", "rowwise")
#: every dimension of an FP8 GEMM must be a multiple of this (CUDA's _scaled_mm)
FP8_MULTIPLE = 16


@rule("train-fp8-mode")
def _mode(cfg: Config, world: int | None) -> str | None:
    if cfg.fp8.recipe not in FP8_MODES:
        return f"fp8.recipe = {cfg.fp8.recipe!r} is not an FP8 recipe; use 'none', 'tensorwise' or 'rowwise'"
    return None


@rule("train-fp8-precision")
def _precision(cfg: Config, world: int | None) -> str | None:
    if cfg.fp8.recipe != "none" and cfg.train.precision == "fp16":
        return ("fp8.recipe with train.precision = 'fp16' is not supported (FP8 GEMMs return bf16 or fp32, and "
                "fp16's loss scale would rescale the FP8 amaxes); use train.precision = 'bf16'")
    return None


def fp8_gemm_dims(cfg: Config) -> dict[str, int]:
    """Each dimension one rank's FP8 GEMMs have, by what it is: the tokens of a micro-batch
    (``M``) and the linear layers' features after the tensor-parallel split (``N``, ``K``)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    dims = {"train.micro_batch x train.seq_len / cp (tokens)": t.micro_batch * t.seq_len // p.cp,
            "model.dim": m.dim,
            "n_heads x head_dim / tp": m.n_heads * m.head_dim // p.tp,
            "n_kv_heads x head_dim / tp": m.n_kv_heads * m.head_dim // p.tp,
            "model.ffn_hidden / tp": m.ffn_hidden // p.tp}
    if m.n_experts and m.n_shared_experts:
        dims["n_shared_experts x expert hidden / tp"] = m.n_shared_experts * m.expert_hidden // p.tp
    return dims


@rule("train-fp8-dims")
def _dims(cfg: Config, world: int | None) -> str | None:
    if cfg.fp8.recipe == "none":
        return None
    for what, size in fp8_gemm_dims(cfg).items():
        if size % FP8_MULTIPLE:
            return (f"fp8.recipe: {what} = {size} is not a multiple of {FP8_MULTIPLE}, which FP8 GEMMs need; "
                    f"change the model or batch shape, or set fp8.recipe = 'none'")
    return None


#: fp8.all_gather's conditions: the only ZeRO stage that gathers parameters, and the
#: recipe whose FP8 weight carries one scale per tensor (what a gathered shard can share)
FP8_GATHER_STAGE = 3
FP8_GATHER_RECIPE = "tensorwise"


def fp8_gathers(fp8: str, fp8_all_gather: bool, zero_stage: int) -> bool:
    """Whether ZeRO-3's parameter all-gathers carry the FP8 linears' weights as FP8: the setting
    is on, at ZeRO-3, with tensorwise FP8. Rule ``parallel-fp8-all-gather`` refuses the setting
    otherwise; the planner, which tries every ZeRO stage under one workload, asks this per layout."""
    return fp8_all_gather and fp8 == FP8_GATHER_RECIPE and zero_stage == FP8_GATHER_STAGE


@rule("parallel-fp8-all-gather")
def _all_gather(cfg: Config, world: int | None) -> str | None:
    if not cfg.fp8.all_gather:
        return None
    if cfg.parallel.zero_stage != FP8_GATHER_STAGE:
        return (f"fp8.all_gather = true needs parallel.zero_stage = 3 (got {cfg.parallel.zero_stage}): "
                "only ZeRO-3 gathers parameters; set parallel.zero_stage = 3 or drop it")
    if cfg.fp8.recipe != FP8_GATHER_RECIPE:
        return (f"fp8.all_gather = true needs fp8.recipe = 'tensorwise' (got {cfg.fp8.recipe!r}): the "
                "gathered FP8 weight carries one scale per tensor (rowwise's backward rescales the weight per "
                "input feature, across the shards); set fp8.recipe = 'tensorwise' or drop it")
    return None


def fp8_device_error(fp8: str, device: str, supported: bool) -> str | None:
    """The message for FP8 on a device without FP8 matmul kernels (``supported`` False: a CUDA GPU
    of capability below 8.9), or None."""
    if fp8 == "none" or supported:
        return None
    return (f"fp8.recipe = {fp8!r} needs FP8 matmul kernels, which {device} does not have (CUDA capability 8.9 "
            "or later: Ada, Hopper, Blackwell; or the CPU); set fp8.recipe = 'none'")
