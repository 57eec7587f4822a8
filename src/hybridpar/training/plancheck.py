"""Every real run checks its plan: ``hybridpar train`` writes the planner's prediction for the
run's own layout and machine beside what the run measured, with the error of each, into
``summary.json`` (``plan_check``) and the final summary lines. A miss beyond the planner's stated
accuracy is named on one line, with the term that missed. ``metrics.jsonl`` is unchanged.

``error`` is ``predicted / measured - 1`` (as ``plan --from-run`` reports it); for traffic it
is ``predicted - measured`` bytes.

* **Step time after warm-up**: the median ``step_time_s`` of the records after step 1
  (:func:`hybridpar.planner.front.fit.warm_step_times`, what ``plan --from-run`` fits to)
  against :func:`hybridpar.planner.front.fit.predict`, on the device model the run resolves
  (:func:`hybridpar.planner.front.auto.resolve_hardware`: ``train.hardware``, else the
  calibrated default profile, else the visible GPU's data sheet, else the built-in CPU core).
  Stated accuracy: 30%, for a profile ``hybridpar calibrate`` measured on this machine
  (docs/explanation/planner-validation.md, section 8). No accuracy is stated for a data sheet
  or the built-in CPU core. A miss is still named, and the line says the model was uncalibrated.
* **Peak memory per rank**: ``peak_memory_bytes_per_rank`` (the GPU allocator's peak; on CPU the
  process's peak resident set, ``VmHWM``) against :func:`hybridpar.planner.front.fit.predicted_rank_peak`
  for the rank's pipeline stage. On a GPU that is the live tensors. On CPU it is the planner's
  resident-set model, whose baseline (interpreter, torch, this library, the process group) is
  the rank's own peak resident set when its Trainer was built, before data and model, plus
  :data:`~hybridpar.planner.machine.allocator.RUN_OVER_IMPORT_BYTES`. Stated accuracy: 10%
  (section 11).
* **Traffic per axis**: the payload bytes the ``Comm`` layer counted in the run's last step
  against :func:`hybridpar.planner.price.traffic.comm_bytes_per_axis` for the rank
  (:func:`planned_traffic`, which the dry run compares with too). Rank 0 reports per axis;
  every rank reports its summed difference. Stated accuracy: exact. With experts over ``ep``,
  the rows routed over the ``ep`` axes depend on the router. The planner prices the busiest rank
  under ``moe_imbalance``, so those axes are compared but not held to the byte.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridpar.config import Config
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.planner.front.auto import resolve_hardware
from hybridpar.planner.front.fit import (
    RunRecord,
    layout_and_workload,
    predict,
    predicted_rank_peak,
    run_record,
    warm_step_times,
)
from hybridpar.planner.machine.allocator import RUN_OVER_IMPORT_BYTES
from hybridpar.planner.price.traffic import comm_bytes_per_axis

STEP_TIME_ACCURACY = 0.30  # calibrated profile: planner-validation.md section 8
MEMORY_ACCURACY = 0.10  # CPU resident set and GPU allocator peak: sections 11 and 3
UNPRICED = -1  # a rank's traffic difference when the planner could not price its step


def planned_traffic(cfg: Config, pp_rank: int, zero_rank: int, ep_load: float | None = None) -> dict[str, int]:
    """The planner's payload bytes per axis of one training step on the rank at pipeline
    coordinate ``pp_rank`` and ZeRO (dp x cp) coordinate ``zero_rank``: what its
    ``Comm`` counter records (``ep_load``: the rank's routed rows over the mean; None: the
    busiest rank's under ``moe_imbalance``)."""
    layout, work = layout_and_workload(cfg)
    p = cfg.parallel
    node = (p.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", "0"))) if p.hierarchical_dp else 0
    return comm_bytes_per_axis(cfg.model, layout, work, pp_rank, zero_rank=zero_rank, hierarchical_node=node,
                               ep_load=ep_load)


def routing_dependent(cfg: Config, axis: str) -> bool:
    """Whether ``axis`` carries routed rows, whose bytes depend on the router (module doc)."""
    return cfg.model.n_experts > 0 and cfg.parallel.ep > 1 and axis.startswith("ep")


def traffic_difference(cfg: Config, pp_rank: int, zero_rank: int, measured: dict[str, int]) -> int:
    """``sum |planned - measured|`` payload bytes over the axes held to the byte, for this rank
    (:data:`UNPRICED` when the planner cannot price the step)."""
    try:
        planned = planned_traffic(cfg, pp_rank, zero_rank)
    except Exception:  # noqa: BLE001 (a report at the end of a run: it never fails the run)
        return UNPRICED
    axes = [a for a in set(planned) | set(measured) if not routing_dependent(cfg, a)]
    return sum(abs(planned.get(a, 0) - measured.get(a, 0)) for a in axes)


def _error(predicted: float | None, measured: float | None) -> float | None:
    return None if predicted is None or not measured else predicted / measured - 1


def _step_time(record: RunRecord, cfg: Config, device: str, world: int) -> dict[str, Any]:
    gpu, source = resolve_hardware(cfg, device)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    predicted = predict(record, gpu, local if local > 0 and world % local == 0 else world)
    measured = record.step_time_s if record.steps_timed else None
    return {"predicted": predicted, "measured": measured, "error": _error(predicted, measured),
            "steps_timed": record.steps_timed, "accuracy": STEP_TIME_ACCURACY,
            "calibrated": gpu.calibration is not None, "device_model": gpu.name, "source": source}


def _memory(record: RunRecord, cfg: Config, cpu_baseline: float | None) -> dict[str, Any]:
    dims = ParallelDims.from_config(cfg.parallel)
    stages = sorted({dims.coords(r)["pp"] for r in range(record.world)})
    baseline = None if cpu_baseline is None else cpu_baseline + RUN_OVER_IMPORT_BYTES
    per_stage = {s: predicted_rank_peak(record.model, record.layout, record.work, record.device, s, baseline)
                 for s in stages}
    predicted = [int(per_stage[dims.coords(r)["pp"]]) for r in range(record.world)]
    measured = list(record.peak_memory)
    what = "peak resident set" if record.device == "cpu" else "GPU allocator peak"
    return {"what": what, "predicted": predicted, "measured": measured, "accuracy": MEMORY_ACCURACY,
            "error": [_error(p, m) for p, m in zip(predicted, measured, strict=True)]}


def _traffic(cfg: Config, rank0: dict[str, int], differences: Sequence[int]) -> dict[str, Any]:
    planned = planned_traffic(cfg, 0, 0)
    axes = sorted(set(planned) | set(rank0))
    return {"rank": 0, "predicted": {a: planned.get(a, 0) for a in axes}, "measured": {a: rank0.get(a, 0) for a in axes},
            "error": {a: planned.get(a, 0) - rank0.get(a, 0) for a in axes}, "accuracy": 0,
            "routing_dependent": [a for a in axes if routing_dependent(cfg, a)],
            "difference_per_rank": list(differences)}


def check_run(cfg: Config, device: str, history: list[dict[str, Any]], memory: list[int],
              rank0_traffic: dict[str, int], differences: Sequence[int], run_dir: Path,
              cpu_baseline: float | None = None) -> dict[str, Any]:
    """``summary.json``'s ``plan_check`` (module doc): the prediction, measurement and error of
    step time, peak memory per rank and traffic per axis, and ``misses``, one line per term
    beyond the planner's stated accuracy. Never raises: a term the planner cannot price says
    why under ``unpriced``."""
    record = run_record(cfg, run_dir, device, warm_step_times(history), tuple(memory))
    out: dict[str, Any] = {}
    unpriced: dict[str, str] = {}
    for term, price in (("step_time_s", lambda: _step_time(record, cfg, device, record.world)),
                        ("peak_memory_bytes_per_rank", lambda: _memory(record, cfg, cpu_baseline)),
                        ("traffic_bytes_per_step", lambda: _traffic(cfg, rank0_traffic, differences))):
        try:
            out[term] = price()
        except Exception as e:  # noqa: BLE001 (a report at the end of a run: it never fails the run)
            unpriced[term] = f"{type(e).__name__}: {e}"
    if unpriced:
        out["unpriced"] = unpriced
    out["misses"] = misses(out)
    return out


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def misses(check: dict[str, Any]) -> list[str]:
    """One line per term of ``check`` beyond the planner's stated accuracy, naming the term."""
    out = []
    st = check.get("step_time_s")
    if st and st["error"] is not None and abs(st["error"]) > st["accuracy"]:
        why = "" if st["calibrated"] else (f"; {st['device_model']} is not calibrated to this machine, for which no "
                                           "accuracy is stated (run hybridpar calibrate)")
        out.append(f"plan check missed: step time predicted {st['predicted']:.4g} s, measured {st['measured']:.4g} s "
                   f"({_pct(st['error'])}, beyond the planner's {st['accuracy']:.0%}{why})")
    mem = check.get("peak_memory_bytes_per_rank")
    bad = [(r, e) for r, e in enumerate(mem["error"] if mem else []) if e is not None and abs(e) > mem["accuracy"]]
    if bad:
        worst = max(bad, key=lambda re: abs(re[1]))[0]
        out.append(f"plan check missed: peak memory ({mem['what']}) on {len(bad)} rank(s), worst rank {worst}: "
                   f"predicted {mem['predicted'][worst] / 2**20:.0f} MiB, measured {mem['measured'][worst] / 2**20:.0f} MiB "
                   f"({_pct(mem['error'][worst])}, beyond the planner's {mem['accuracy']:.0%})")
    tr = check.get("traffic_bytes_per_step")
    if tr:
        axes = [f"{a} {d:+,} B" for a, d in tr["error"].items() if d and a not in tr["routing_dependent"]]
        ranks = [r for r, d in enumerate(tr["difference_per_rank"]) if d]
        if axes or ranks:
            out.append(f"plan check missed: traffic is not the planner's to the byte (rank 0: "
                       f"{', '.join(axes) or 'exact'}; ranks differing: {ranks or 'none'}, {UNPRICED} = unpriced)")
    return out


def lines(check: dict[str, Any]) -> list[str]:
    """The final summary lines: each term beside its prediction, then the misses."""
    out = []
    st = check.get("step_time_s")
    if st:
        measured = "no step after warm-up to time" if st["measured"] is None else (
            f"measured {st['measured']:.4g} s ({_pct(st['error'])})")
        out.append(f"plan check: step time predicted {st['predicted']:.4g} s on {st['device_model']} "
                   f"({st['source']}), {measured}")
    mem = check.get("peak_memory_bytes_per_rank")
    if mem:
        ranks = " ".join(f"r{r} {p / 2**20:.0f}/{m / 2**20:.0f}" for r, (p, m) in
                         enumerate(zip(mem["predicted"], mem["measured"], strict=True)))
        errs = [abs(e) for e in mem["error"] if e is not None]
        out.append(f"plan check: peak memory ({mem['what']}) predicted/measured MiB: {ranks}"
                   + (f" (worst error {max(errs):.1%})" if errs else ""))
    tr = check.get("traffic_bytes_per_step")
    if tr:
        axes = ", ".join(f"{a} {tr['predicted'][a]:,}/{tr['measured'][a]:,} B" for a in tr["predicted"])
        out.append(f"plan check: traffic rank 0 predicted/measured payload: {axes or 'none'}; "
                   f"every rank's difference: {sorted(set(tr['difference_per_rank']))} B")
    out += [f"plan check: not priced: {term}: {why}" for term, why in check.get("unpriced", {}).items()]
    return out + check["misses"]
