"""Draw a pipeline timeline (one row per rank: F, B, W and idle) as a PNG, and the
``hybridpar timeline`` command that simulates a schedule and draws it.

The input is a :class:`~.simulate.Timeline`, simulated (:func:`~.simulate.simulate`) or recorded
by the runtime (:meth:`~.runtime.PipelineRunner.gather_timeline`), so both look the same.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridpar.parallel.pipeline.schedules import (
    ActionKind,
    PipelineSchedule,
    Schedule,
    ScheduleError,
    build_schedule,
    schedule_warnings,
)
from hybridpar.parallel.pipeline.simulate import Costs, Timeline, simulate, textbook_bubble

COLORS = {ActionKind.F: "#4C78A8", ActionKind.B: "#F58518", ActionKind.W: "#54A24B"}
IDLE_COLOR = "#E6E6E6"


def plot_timeline(timeline: Timeline, out: str | Path, title: str = "") -> Path:
    """Write ``timeline`` as a PNG to ``out`` (matplotlib, Agg backend); returns the path.

    Each compute action is a box labelled with its micro-batch; lighter shades mark later
    virtual chunks; grey is idle. The title carries the makespan and bubble fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch

    n = len(timeline.ranks)
    span = timeline.makespan or 1.0
    stages = max((iv.action.stage for row in timeline.ranks for iv in row), default=0) + 1
    virtual = max(1, -(-stages // max(n, 1)))
    fig, ax = plt.subplots(figsize=(min(24.0, 4.0 + 0.18 * sum(len(r) for r in timeline.ranks) / max(n, 1)),
                                    0.6 * n + 1.4))
    for r, row in enumerate(timeline.ranks):
        y = n - 1 - r
        for start, end in timeline.idle_intervals(r):
            ax.barh(y, end - start, left=start, height=0.8, color=IDLE_COLOR, edgecolor="none")
        for iv in row:
            shade = 1.0 - 0.45 * (iv.action.stage // n) / max(1, virtual - 1)
            color = tuple(1 - shade * (1 - c) for c in to_rgb(COLORS[iv.action.kind]))
            ax.barh(y, iv.end - iv.start, left=iv.start, height=0.8, color=color,
                    edgecolor="white", linewidth=0.5)
            if (iv.end - iv.start) / span > 0.012:
                ax.text((iv.start + iv.end) / 2, y, str(iv.action.microbatch), ha="center",
                        va="center", fontsize=7, color="white")
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(n))])
    ax.set_xlim(0, span)
    ax.set_xlabel("time")
    head = f"{title}  " if title else ""
    ax.set_title(f"{head}makespan {span:.4g}, bubble {timeline.bubble_fraction:.1%}")
    ax.legend(handles=[Patch(color=COLORS[k], label=k.value) for k in COLORS] +
              [Patch(color=IDLE_COLOR, label="idle")], loc="upper center", ncol=4,
              bbox_to_anchor=(0.5, -0.35 if n < 3 else -0.2), frameon=False, fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def describe(sched: PipelineSchedule, timeline: Timeline) -> str:
    """One paragraph: schedule, makespan, bubble (simulated and textbook), in-flight promise."""
    inflight = ", ".join(str(sched.promised_in_flight(r)) for r in range(sched.pp))
    return (f"{sched.kind.value}: pp={sched.pp} V={sched.virtual_stages} M={sched.microbatches}  "
            f"makespan {timeline.makespan:.4g}  bubble {timeline.bubble_fraction:.2%} "
            f"(textbook {textbook_bubble(sched):.2%} at equal stage costs)  "
            f"peak stored activations per rank: {inflight}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hybridpar timeline",
        description="Simulate a pipeline schedule and draw its per-rank timeline (F, B, W, idle) as a PNG. "
        "Costs are per stage (a virtual chunk costs 1/V of them).")
    p.add_argument("--config", help="take pp, schedule, virtual stages and micro-batches from this TOML "
                   "(flags given explicitly win)")
    p.add_argument("--pp", type=int, default=None, help="pipeline ranks (default 4)")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default 8)")
    p.add_argument("--schedule", choices=[s.value for s in Schedule], default=None,
                   help="default 1f1b")
    p.add_argument("--virtual-stages", type=int, default=None, help="chunks per rank (interleaved; zbv has 2)")
    p.add_argument("--t-f", type=float, default=1.0, help="forward time of one stage")
    p.add_argument("--t-b", type=float, default=2.0, help="full backward time of one stage")
    p.add_argument("--t-w", type=float, default=None,
                   help="the weight-gradient part of --t-b (zb-h1 and zbv split it off; default t_b / 2)")
    p.add_argument("--t-p2p", type=float, default=0.0, help="time of one activation transfer")
    p.add_argument("--out", default="timeline.png", help="PNG to write")
    return p


def _from_config(path: str) -> dict[str, object]:
    from hybridpar.config import load_config

    cfg = load_config(path, [])
    p = cfg.parallel
    micro = p.microbatches or cfg.microbatches
    return {"pp": p.pp, "microbatches": micro, "schedule": p.pipeline_schedule,
            "virtual_stages": p.virtual_stages}


def cmd_timeline(argv: list[str]) -> int:
    """``hybridpar timeline --pp 4 --microbatches 8 --schedule 1f1b [--virtual-stages 2]
    [--out timeline.png]``: simulate, print makespan and bubble, write the PNG."""
    args = _parser().parse_args(argv)
    values: dict[str, object] = {"pp": 4, "microbatches": 8, "schedule": "1f1b", "virtual_stages": 1}
    if args.config:
        values.update(_from_config(args.config))
    for key in values:
        given = getattr(args, key)
        if given is not None:
            values[key] = given
    kind = Schedule.parse(str(values["schedule"]))
    v = int(values["virtual_stages"]) if kind is Schedule.INTERLEAVED else 2 if kind is Schedule.ZBV else 1
    if kind is Schedule.INTERLEAVED and args.virtual_stages is None and not args.config:
        v = 2
    pp, m = int(values["pp"]), int(values["microbatches"])
    t_w = args.t_b / 2 if args.t_w is None else args.t_w
    if not 0 <= t_w <= args.t_b:
        raise ScheduleError(f"--t-w {t_w} must be between 0 and --t-b {args.t_b}")
    sched = build_schedule(kind, pp, v, m)
    for warning in schedule_warnings(kind, pp, v, m):
        print(f"hybridpar: warning: {warning}")
    timeline = simulate(sched, Costs(args.t_f, args.t_b - t_w, t_w, args.t_p2p).per_chunk(v))
    out = plot_timeline(timeline, args.out, f"{kind.value} pp={pp} V={v} M={m}")
    print(describe(sched, timeline))
    print(f"bubble fraction: {timeline.bubble_fraction:.4f}")
    print(f"wrote {out}")
    return 0
