"""``hybridpar plan --mttf 3h``: the snapshot and checkpoint intervals that maximise goodput at the
cluster's size, and the goodput to expect (Young 1974, Daly 2006).

A failure costs the work since the last save plus the restart; a save costs what it stalls
training. Young/Daly's optimal interval is ``tau = sqrt(2 * delta * M) - delta`` for a save that
stalls ``delta`` seconds and a mean time to failure ``M``, and the useful share of time is
``tau / (tau + delta) * (1 - (R + (tau + delta) / 2) / M)`` with ``R`` the recovery time.

The inputs, from the planner's best layout: its step time ``T`` and each GPU's training state
(parameters and optimizer state, the bytes a snapshot and a checkpoint hold); the GPU's host link
(``host_bw``), network (``inter_bw``) and disk (``disk_bw``) bandwidths. ``M`` scales with the
cluster: ``--mttf`` is measured at ``--mttf-gpus`` GPUs (default 16384: Llama 3's 419
interruptions in 54 days, one about every 3 hours), ``M = mttf * mttf_gpus / gpus``.

* In-memory snapshots: the copy to host memory and the replica to the next node overlap the next
  step (``train.snapshot_every``), so they stall only what exceeds ``T``; recovery is the restart
  plus reading the state back over the host link. Durable disk checkpoints beside them every
  ``--durable-every`` seconds cost their write.
* Disk checkpoints only: a save stalls the state's write to disk; recovery is the restart plus the
  read.

``--restart-s`` is the restart itself (processes, rendezvous, model build; ``benchmarks/goodput.py``
measures it): 60 s by default.
"""

from __future__ import annotations

import math
import re
from typing import Any, cast

from hybridpar.planner.machine.hardware import Cluster, PlanError
from hybridpar.planner.search.search import Evaluation

UNITS = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str, flag: str) -> float:
    """``"3h"``, ``"20m"``, ``"90s"``, ``"1.5d"`` (or plain seconds) in seconds; a PlanError naming the value."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|m|min|h|d)?\s*", text)
    if m is None or float(m.group(1)) <= 0:
        raise PlanError(f"{flag} {text!r} must be a positive duration such as 3h, 20m or 90s")
    return float(m.group(1)) * UNITS[m.group(2) or "s"]


def young_daly(delta: float, mttf: float) -> float:
    """The optimal save interval (s) for a save stalling ``delta`` s at mean time to failure ``mttf``."""
    if delta <= 0:
        return 0.0
    tau = math.sqrt(2 * delta * mttf)
    return tau - delta if delta < mttf / 2 else tau


def useful_share(tau: float, delta: float, recovery: float, mttf: float) -> float:
    """The share of wall time spent on work that is kept (Young/Daly's first-order model)."""
    if tau <= 0:
        return 0.0
    return max(0.0, tau / (tau + delta) * (1 - (recovery + (tau + delta) / 2) / mttf))


def _every(tau: float, step: float) -> int:
    return max(1, round(tau / step)) if step > 0 else 1


def resilience(best: Evaluation, cluster: Cluster, mttf_s: float, mttf_gpus: int, restart_s: float,
               durable_every_s: float) -> dict[str, object]:
    """The intervals and goodput of snapshots against disk checkpoints only (module doc)."""
    if best.cost is None or best.memory is None:
        raise PlanError("--mttf needs a layout that fits, to price its saves")
    gpu, step = cluster.gpu, best.cost.step_time_s
    comps = best.memory.components
    state = comps["params"] + comps["optimizer"] + best.memory.cpu_bytes
    mttf = mttf_s * mttf_gpus / cluster.world_size
    copy = state / gpu.host_bw + (state / gpu.inter_bw if cluster.nodes > 1 else 0.0)
    snap_delta = max(0.0, copy - step)  # what the copy and replica add beyond the step they overlap
    snap_tau = max(step, young_daly(snap_delta, mttf))
    snap_every = _every(snap_tau, step)
    snap_tau = snap_every * step
    snap_recovery = restart_s + state / gpu.host_bw
    disk_delta = state / gpu.disk_bw
    durable = 1 - disk_delta / durable_every_s if durable_every_s > 0 else 1.0
    snap_good = useful_share(snap_tau, snap_delta, snap_recovery, mttf) * max(durable, 0.0)
    disk_tau = max(step, young_daly(disk_delta, mttf))
    disk_every = _every(disk_tau, step)
    disk_recovery = restart_s + state / gpu.disk_bw
    disk_good = useful_share(disk_every * step, disk_delta, disk_recovery, mttf)
    return {"mttf_s": mttf, "gpus": cluster.world_size, "step_time_s": step, "state_bytes_per_gpu": state,
            "restart_s": restart_s,
            "snapshot": {"every_steps": snap_every, "interval_s": snap_tau, "save_stall_s": snap_delta,
                         "recovery_s": snap_recovery, "durable_every_s": durable_every_s, "goodput": snap_good},
            "disk_only": {"every_steps": disk_every, "interval_s": disk_every * step, "save_stall_s": disk_delta,
                          "recovery_s": disk_recovery, "goodput": disk_good}}


def lines(doc: dict[str, object]) -> list[str]:
    """``plan --mttf``'s words for :func:`resilience`'s answer."""
    s, d = cast(dict[str, Any], doc["snapshot"]), cast(dict[str, Any], doc["disk_only"])
    mttf = float(doc["mttf_s"])  # type: ignore[arg-type]
    return [
        f"\nfailures: one every {mttf / 3600:.2f} h on {doc['gpus']} GPUs (step {float(doc['step_time_s']):.2f} s, "
        f"{float(doc['state_bytes_per_gpu']) / 2**30:.2f} GiB of training state per GPU, restart "
        f"{float(doc['restart_s']):.0f} s)",
        f"  in-memory snapshots: every {s['every_steps']} step{'s' if s['every_steps'] != 1 else ''} "
        f"(train.snapshot_every = {s['every_steps']}; stall {s['save_stall_s']:.2f} s each, recovery "
        f"{s['recovery_s']:.0f} s), durable checkpoints every {s['durable_every_s'] / 3600:.1f} h: "
        f"expected goodput {100 * s['goodput']:.1f}%",
        f"  disk checkpoints only: every {d['every_steps']} steps (train.checkpoint_every = {d['every_steps']}, "
        f"{d['interval_s'] / 60:.1f} min; stall {d['save_stall_s']:.1f} s each, recovery {d['recovery_s']:.0f} s): "
        f"expected goodput {100 * d['goodput']:.1f}%",
    ]
