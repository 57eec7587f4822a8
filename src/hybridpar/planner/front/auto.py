"""``hybridpar train --parallel.auto true``: the planner picks the layout before launch.

For the world size being launched (``--nproc``, or torchrun's ``WORLD_SIZE``), every
factorisation ``dp * tp * pp * cp`` is completed by :func:`hybridpar.planner.search.search.complete`
(micro-batch size, pipeline schedule and virtual stages, ZeRO stage) and every completion that
``hybridpar.config.validate`` accepts for this trainer is ranked by the cost model's step time.
The user's own settings that are not layout choices stay as given: sequence parallelism,
offload, the batch and sequence sizes, precision. Layout choices the user made explicitly are
kept as constraints: a mesh axis (``dp``, ``tp``, ``pp``, ``cp``) set above 1, a ZeRO stage
above 0 and a recompute mode other than ``none``; the planner chooses only the rest (an error if
no layout of the world size keeps them). Left at ``none``, recomputation is used only for
layouts that fit in memory no other way (the search tries ``none``, then ``selective``, then
``full``). For a mixture-of-experts model the expert-parallel degree ``ep`` is chosen too (kept
when set above 1). The winner is written into the config, which then goes through the usual validation
and launch; the choice and the runners-up (memory, predicted step time, why the others lost)
are printed first.

The device model comes from ``train.hardware`` (a known GPU name or a profile from
``hybridpar calibrate``), else the calibrated default profile if one was written, else a
built-in spec: the data sheet of the visible GPU, or :data:`CPU_CORE` for CPU ranks.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from hybridpar.config import Config, ConfigError
from hybridpar.distributed import device as devices
from hybridpar.planner.machine.hardware import (
    CPU_CORE,
    GPUS,
    Cluster,
    GiB,
    GPUSpec,
    PlanError,
    gpu_spec,
)
from hybridpar.planner.machine.profile import default_profile_path, usable_cores
from hybridpar.planner.model.layout import Layout, Workload
from hybridpar.planner.search.search import ZERO, Evaluation, complete, factorisations
from hybridpar.rules import first_broken

# One CPU core running one rank over gloo on the same machine, for when nothing was calibrated:
# a core with two 256-bit FMA units at ~3 GHz peaks near 100 GFLOP/s fp32 (~60 reached by
# MKL/oneDNN on training-sized GEMMs), streams ~10 GB/s from DRAM, and gloo over loopback TCP
# takes ~0.1-1 ms per collective at ~1 GB/s. Rough on purpose: `hybridpar calibrate` measures.

# Fields the planner may set; everything else in [parallel] and [train] stays the user's.
CHOSEN = ("dp", "tp", "pp", "cp", "ep", "zero_stage", "pipeline_schedule", "virtual_stages", "recompute",
          "offload_activations", "offload_activations_fraction", "micro_batch", "dp_shard")


def resolve_hardware(cfg: Config, device_type: str) -> tuple[GPUSpec, str]:
    """(device spec, where it came from) for ``parallel.auto`` (see the module docstring)."""
    if cfg.train.hardware:
        return gpu_spec(cfg.train.hardware), f"train.hardware = {cfg.train.hardware!r}"
    default = default_profile_path()
    if default.is_file():
        return gpu_spec(str(default)), f"calibrated profile {default}"
    if device_type == "cuda":
        import torch

        name = devices.device_name(torch.device("cuda", 0))
        known = {"B200": "B200", "H200": "H200", "H100": "H100-SXM",
                 "A100": "A100-80GB" if "80GB" in name else "A100-40GB"}
        for marker, key in known.items():
            if marker in name:
                return GPUS[key], f"{key} data sheet (GPU {name!r}; run hybridpar calibrate to measure)"
        return GPUS["H100-SXM"], f"H100-SXM data sheet (unknown GPU {name!r}; run hybridpar calibrate)"
    return CPU_CORE, "built-in CPU core spec (run hybridpar calibrate for measured rates)"


@dataclass
class AutoChoice:
    """The chosen layout, the ranked runnable candidates and the rejected ones with reasons."""

    best: Evaluation
    ranked: list[Evaluation]
    rejected: dict[str, int] = field(default_factory=dict)
    hardware: str = ""
    source: str = ""
    world: int = 1
    pinned: dict[str, object] = field(default_factory=dict)
    reason: str = ""  # why the best was chosen

    def explain(self, top: int = 5) -> str:
        """What the CLI prints: the choice, the runners-up and what was ruled out."""
        b = self.best
        assert b.cost is not None and b.memory is not None
        lines = [f"hybridpar: parallel.auto: {self.world} processes on {self.hardware} ({self.source})",
                 f"hybridpar: chose {describe(b.layout)}: predicted {b.cost.step_time_s:.3f} s/step, "
                 f"{b.cost.tokens_per_s:,.0f} tokens/s, {b.memory.total / GiB:.2f} of {b.capacity / GiB:.1f} GiB "
                 "per rank"]
        if self.reason:
            lines.append(f"hybridpar: why: {self.reason}")
        if self.pinned:
            lines.append("hybridpar: kept from the config: " + ", ".join(f"{k}={v}" for k, v in self.pinned.items()))
        lines += [f"  {'rank':>4}  {'layout':<52} {'step s':>8} {'vs best':>8} {'GiB':>6}"]
        for i, ev in enumerate(self.ranked[:top], 1):
            assert ev.cost is not None and ev.memory is not None
            ratio = ev.cost.step_time_s / b.cost.step_time_s
            lines.append(f"  {i:>4}  {describe(ev.layout):<52} {ev.cost.step_time_s:>8.3f} {ratio:>7.2f}x "
                         f"{ev.memory.total / GiB:>6.2f}")
        if len(self.ranked) > top:
            lines.append(f"  ... {len(self.ranked) - top} more runnable layouts, all slower")
        for why, n in sorted(self.rejected.items(), key=lambda kv: -kv[1]):
            lines.append(f"  ruled out {n}: {why}")
        return "\n".join(lines)


def describe(L: Layout) -> str:
    """``dp=2,tp=1,pp=2,cp=1 mb=4 zero=0 1f1b`` (schedule only when pp > 1)."""
    sched = f" {L.pipeline_schedule}{f'x{L.virtual_stages}' if L.virtual_stages > 1 else ''}" if L.pp > 1 else ""
    return f"{L.short()} mb={L.micro_batch} zero={L.zero_stage}{sched}"


def apply_layout(cfg: Config, layout: Layout) -> Config:
    """A copy of ``cfg`` with the planner's fields (:data:`CHOSEN`) set and ``auto`` off."""
    par = dataclasses.replace(cfg.parallel, auto=False, microbatches=0,
                              **{k: getattr(layout, k) for k in CHOSEN if k != "micro_batch"})
    train = dataclasses.replace(cfg.train, micro_batch=layout.micro_batch)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model), parallel=par, train=train)


def _runnable(cfg: Config, ev: Evaluation, world: int) -> str | None:
    """Why the trainer would refuse this evaluation's layout, or None if it runs and fits."""
    if ev.reason is not None:
        return ev.reason
    if not ev.fits or ev.cost is None:
        return "does not fit in device memory"
    broken = first_broken(apply_layout(cfg, ev.layout), world)
    return None if broken is None else broken.reason


def pinned_choices(cfg: Config) -> dict[str, object]:
    """The layout choices the config makes explicitly, which ``parallel.auto`` keeps: mesh axes
    above 1, a ZeRO stage above 0, a recompute mode, a ZeRO group size, activation offload (their
    defaults mean
    "planner's choice")."""
    p = cfg.parallel
    out: dict[str, object] = {k: getattr(p, k) for k in ("dp", "tp", "pp", "cp", "ep") if getattr(p, k) > 1}
    if p.zero_stage > 0:
        out["zero_stage"] = p.zero_stage
    if p.recompute != "none":
        out["recompute"] = p.recompute
    if p.dp_shard > 0:
        out["dp_shard"] = p.dp_shard
    if p.offload_activations:
        out |= {"offload_activations": True, "offload_activations_fraction": p.offload_activations_fraction}
    return out


def _partial(pinned: dict[str, object], partial: dict[str, object]) -> dict[str, object] | None:
    """``partial`` (axes, ZeRO stage, kept settings) with the pinned ep and dp_shard, which must
    divide its dp x cp (None where they do not); sequence parallelism off without tp or with cp.
    Without a pinned ep, complete() tries every ep of dp x cp (a mixture-of-experts model)."""
    n = int(partial["dp"]) * int(partial["cp"])  # type: ignore[call-overload]
    for key in ("ep", "dp_shard"):
        if key in pinned:
            partial[key] = pinned[key]
            if n % int(pinned[key]):  # type: ignore[call-overload]
                return None
    if partial["tp"] == 1 or int(partial["cp"]) > 1:  # type: ignore[call-overload]
        partial["sequence_parallel"] = False
    return partial


def choose_layout(cfg: Config, world: int, device_type: str = "cpu", gpus_per_node: int | None = None,
                  spec: tuple[GPUSpec, str] | None = None) -> AutoChoice:
    """Rank every runnable layout of ``cfg.model`` on ``world`` ranks that keeps the config's
    explicit choices (:func:`pinned_choices`); raise if none runs."""
    if world < 1:
        raise ConfigError(f"parallel.auto needs a world size >= 1, got {world}")
    pinned = pinned_choices(cfg)
    axes = {k: int(v) for k, v in pinned.items() if k in ("dp", "tp", "pp", "cp")}  # type: ignore[call-overload]
    product = 1
    for v in axes.values():
        product *= v
    if world % product:
        kept = " x ".join(f"{k}={v}" for k, v in axes.items())
        raise ConfigError(f"parallel.auto keeps the axes set in the config ({kept} = {product} ranks), but "
                          f"{product} does not divide the world size {world}; set --nproc to a multiple of "
                          f"{product}, or leave those axes at 1 for the planner to choose")
    gpu, source = spec if spec is not None else resolve_hardware(cfg, device_type)
    cluster = Cluster.of(gpu, world, gpus_per_node or world)
    t, p = cfg.train, cfg.parallel
    work = Workload(t.global_batch, t.seq_len, t.precision, half_params=False, bucket_mb=p.bucket_mb,
                    loss_chunk_tokens=t.loss_chunk_tokens)
    keep: dict[str, object] = {"sequence_parallel": p.sequence_parallel, "offload_optimizer": p.offload_optimizer}
    for k in ("recompute", "offload_activations", "offload_activations_fraction"):
        if k in pinned:  # else the search recomputes (offloads) only where nothing fits without it
            keep[k] = pinned[k]
    ranked: list[Evaluation] = []
    rejected: dict[str, int] = {}
    zeros = [pinned["zero_stage"]] if "zero_stage" in pinned else ZERO
    for (dp, tp, pp, cp), zero in itertools.product(factorisations(world), zeros):
        if any(dict(dp=dp, tp=tp, pp=pp, cp=cp)[k] != v for k, v in axes.items()):
            continue
        # each ZeRO stage separately: the fastest may be one this trainer refuses for the layout
        partial = _partial(pinned, dict(dp=dp, tp=tp, pp=pp, cp=cp, zero_stage=zero, **keep))
        if partial is None:
            continue
        try:
            _, tried = complete(cfg.model, partial, work, cluster)
        except (ConfigError, PlanError) as e:
            rejected[e.reason] = rejected.get(e.reason, 0) + 1
            continue
        for ev in tried:
            why = _runnable(cfg, ev, world)
            if why is None:
                ranked.append(ev)
            else:
                rejected[why] = rejected.get(why, 0) + 1
    ranked.sort(key=lambda e: (e.cost.step_time_s, e.layout.world_size - e.layout.dp))  # type: ignore[union-attr]
    if "zero_stage" not in pinned:
        ranked = _zero3_where_needed(ranked, rejected)
    if not ranked:
        reasons = "; ".join(f"{why} ({n}x)" for why, n in sorted(rejected.items(), key=lambda kv: -kv[1])[:3])
        kept = f" keeping {', '.join(f'{k}={v}' for k, v in pinned.items())}" if pinned else ""
        raise ConfigError(f"parallel.auto found no layout of this model that the trainer can run on {world} "
                          f"process(es){kept}: {reasons}; change the world size (--nproc), the batch sizes"
                          f"{' or the settings kept' if pinned else ''}")
    return AutoChoice(ranked[0], ranked, rejected, gpu.name, source, world, pinned, _reason(ranked, rejected,
                                                                                      "zero_stage" in pinned))


ZERO3_UNNEEDED = ("ZeRO-3 where a layout without it fits (its per-layer parameter gathers cost more than "
                  "the cost model predicts for small layers; it is for models that need its memory)")


def _zero3_where_needed(ranked: list[Evaluation], rejected: dict[str, int]) -> list[Evaluation]:
    """``ranked`` without its ZeRO-3 layouts when any layout without ZeRO-3 runs (counted in
    ``rejected``): ZeRO-3 buys memory, and its gather latency is where the predictions of small
    models run furthest ahead of the measured step time."""
    lower = [e for e in ranked if e.layout.zero_stage < 3]
    if lower and len(lower) < len(ranked):
        rejected[ZERO3_UNNEEDED] = len(ranked) - len(lower)
        return lower
    return ranked


def _reason(ranked: list[Evaluation], rejected: dict[str, int], zero_pinned: bool) -> str:
    """Why the first of ``ranked`` was chosen, in one sentence."""
    best = ranked[0]
    assert best.memory is not None
    why = (f"the fastest predicted of {len(ranked)} runnable layouts; it fits in {best.memory.total / GiB:.2f} of "
           f"{best.capacity / GiB:.1f} GiB per rank with ZeRO-{best.layout.zero_stage} and recompute "
           f"{best.layout.recompute}")
    if best.layout.zero_stage == 3:
        why += " (ZeRO-3 kept from the config)" if zero_pinned else " (ZeRO-3: no layout without it fits)"
    elif ZERO3_UNNEEDED in rejected:
        why += "; ZeRO-3 layouts were left out: not needed for memory here"
    return why


def plan_for_launch(cfg: Config, world: int, device_type: str, gpus_per_node: int | None = None,
                    verbose: bool = True) -> Config:
    """``cfg`` with the planner's layout for ``world`` ranks (printing why when ``verbose``)."""
    choice = choose_layout(cfg, world, device_type, gpus_per_node)
    if verbose:
        print(choice.explain(), flush=True)
    return apply_layout(cfg, choice.best.layout)


def layout_overrides(cfg: Config) -> list[str]:
    """Command-line overrides that pin ``cfg``'s chosen layout for launched workers."""
    p = cfg.parallel
    out = ["--parallel.auto", "false"]
    for k in CHOSEN:
        value = cfg.train.micro_batch if k == "micro_batch" else getattr(p, k)
        out += [f"--{'train' if k == 'micro_batch' else 'parallel'}.{k}", str(value)]
    return out


def default_world(device_type: str) -> int:
    """Processes to launch for ``parallel.auto`` without ``--nproc``: one per GPU, else per core."""
    if device_type == "cuda":

        return max(1, devices.accelerator_count())

    return usable_cores()


def auto_config(cfg: Config, nproc: int | None, local_processes: int | None = None,
                verbose: bool = True) -> Config:
    """The train command's entry: ``cfg`` with the planned layout for ``nproc`` ranks (default
    :func:`default_world`), ``local_processes`` of them per node (default all)."""
    world = nproc if nproc is not None else default_world("cuda" if devices.prefers_gpu(cfg.train.device) else "cpu")
    kind = devices.resolve_device_type(cfg.train.device, local_processes or world)
    return plan_for_launch(cfg, world, kind, gpus_per_node=local_processes, verbose=verbose)
