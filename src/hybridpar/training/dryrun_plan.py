"""``hybridpar plan --dry-run [K]``: the dry run (:mod:`hybridpar.training.dryrun`) on the plan's
top layouts, so a layout that cannot build is never ranked first.

The ranked layouts are tried in the plan's order until ``K`` have built. Each one becomes the
config ``hybridpar train`` would be given (:func:`hybridpar.planner.model.layout.to_config`). That
config first goes through every rule the trainer checks (``validate``). The search skips the
``runtime-*`` rules, which name what this trainer cannot run yet but the planner prices, such as
DeepSeek-V3's multi-token prediction under tp, cp or pp. So a refusal there costs no build. A
layout the rules accept is then dry-run on fake tensors, in this process: the ranks that differ
(the first two of :func:`~hybridpar.training.dryrun.default_ranks`), two steps each, the second
measured. A layout is dropped, with one line saying why, when the rules refuse it, when it fails
to build or run, or when a rank's measured peak of live tensors plus the planner's allocator
overhead (:mod:`hybridpar.planner.machine.allocator`) exceeds the device's usable memory: what
``hybridpar train`` would allocate does not fit. The others carry their ranks' measured traffic,
FLOPs and peak live tensor bytes beside the planner's.

The planner numbers shown beside the dry run are those of the run the trainer would make:
fp32 parameters under bf16/fp16 autocast, as ``train --dry-run`` compares them. ``plan``'s table
prices half-precision parameters (Megatron-LM's, DeepSpeed's) by default, so its memory column
can differ from these.
"""

from __future__ import annotations

from hybridpar.config import ConfigError, ModelConfig, validate
from hybridpar.planner.front.cli import Checked
from hybridpar.planner.machine.hardware import GiB
from hybridpar.planner.model.layout import Workload, to_config
from hybridpar.planner.search.search import Evaluation
from hybridpar.training.dryrun import RankRun, default_ranks, dry_run

STEPS = 2  # the first warms up (the optimizer state appears in it); the second is measured
RANKS = 2  # per layout: the first two of the ranks that differ


def check_layouts(model: ModelConfig, work: Workload, ranked: list[Evaluation], k: int) -> list[Checked]:
    """Dry-run ``ranked`` in order until ``k`` layouts have built (module doc); each tried one
    with why it cannot build, or its ranks' measures beside the planner's."""
    if k < 1:
        raise ConfigError(f"plan --dry-run {k}: the number of layouts to dry-run must be >= 1")
    out: list[Checked] = []
    for ev in ranked:
        if sum(1 for c in out if c.refused is None) == k:
            break
        out.append(check_layout(model, work, ev))
    return out


def check_layout(model: ModelConfig, work: Workload, ev: Evaluation) -> Checked:
    """One layout: refused by the trainer's rules, failed to build or run, or its ranks' measures."""
    cfg = to_config(model, ev.layout, work)
    try:
        validate(cfg, world_size=ev.layout.world_size)
    except ConfigError as e:
        return Checked(ev, refused=f"the trainer refuses it: {_one_line(e)}")
    try:
        runs = dry_run(cfg, default_ranks(cfg)[:RANKS], STEPS)
    except Exception as e:  # noqa: BLE001 (whatever fails to build it is the verdict, said in one line)
        return Checked(ev, refused=f"the dry run failed to build or run it: {type(e).__name__}: {_one_line(e)}")
    worst = max(runs, key=lambda r: r.memory["total"] + r.memory_planned["overhead"])
    need = worst.memory["total"] + worst.memory_planned["overhead"]
    if ev.capacity and need > ev.capacity:  # what `hybridpar train` would allocate does not fit the device
        return Checked(ev, refused=f"does not fit: rank {worst.rank}'s dry run peaks at "
                       f"{worst.memory['total'] / GiB:.2f} GiB of live tensors, with the planner's "
                       f"{worst.memory_planned['overhead'] / GiB:.2f} GiB allocator overhead over the "
                       f"{ev.capacity / GiB:.2f} GiB usable", ranks=[measures(r) for r in runs])
    return Checked(ev, ranks=[measures(r) for r in runs])


def measures(r: RankRun) -> dict[str, object]:
    """A dry-run rank as ``plan`` reports it: traffic per axis, FLOPs and peak live tensor bytes,
    each beside the planner's."""
    planned = r.memory_planned["tensors"]
    return {"rank": r.rank, "why": r.why, "traffic": r.traffic, "traffic_planned": r.traffic_planned,
            "traffic_diff": r.traffic_diff(), "flops": r.flops, "flops_planned": r.flops_planned,
            "peak_bytes": r.memory["total"], "peak_planned_bytes": planned,
            "peak_error": r.memory["total"] / planned - 1 if planned else None, "seconds": r.seconds}


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
