"""Planner time model vs this machine: predicted step time (planner/price/cost.py with a calibrated
hardware profile) against the measured step time of the real Trainer, layout by layout.

One gloo process per core, one thread each (the way ``hybridpar calibrate`` measured the
rates). For each layout of the tiny preset the Trainer runs ``--steps`` optimizer steps; the
measured time is the median step time excluding the first. The prediction is
:func:`hybridpar.planner.price.cost.step_cost` for the same layout, workload (fp32, fp32 parameters)
and a one-node cluster of ``world`` calibrated devices. Target: every row within 30%.

Without ``--profile`` a quick calibration runs first (``hybridpar calibrate --quick``), so the
rates are measured under the same machine load as the training steps.

    python benchmarks/planner_time.py [--profile FILE] [--steps 6] [--repeats 2] [--breakdown] [--section.key value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _spawn import run_ranks

from hybridpar.config import Config, load_config, validate
from hybridpar.distributed.device import keep_host_heap
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.planner.machine.calibrate import calibrate
from hybridpar.planner.machine.hardware import Cluster, gpu_spec
from hybridpar.planner.model.layout import Layout, Workload
from hybridpar.planner.price.cost import step_cost
from hybridpar.training.trainer import Trainer

# (name, parallel.* and train.micro_batch overrides): world 1 and 2 on a 2-core machine
LAYOUTS: list[tuple[str, dict[str, Any]]] = [
    ("dp1", {}),
    ("dp2", {"dp": 2}),
    ("dp2 zero3", {"dp": 2, "zero_stage": 3}),
    ("tp2", {"tp": 2}),
    ("tp2 sp", {"tp": 2, "sequence_parallel": True}),
    ("pp2 1f1b", {"pp": 2}),
    ("pp2 1f1b mb2", {"pp": 2, "micro_batch": 2}),
    ("pp2 zb-h1 mb2", {"pp": 2, "micro_batch": 2, "pipeline_schedule": "zb-h1"}),
    ("dp1 recompute", {"recompute": "full"}),
    ("tp2 sp recompute", {"tp": 2, "sequence_parallel": True, "recompute": "full"}),
]


def make_config(overrides: list[str], layout: dict[str, Any], run_dir: str) -> Config:
    cfg = load_config(None, ["--train.run_dir", run_dir, *overrides])
    for key, value in layout.items():
        if key == "micro_batch":
            cfg.train.micro_batch = value
        else:
            setattr(cfg.parallel, key, value)
    validate(cfg, world_size=cfg.parallel.world_size)
    return cfg


def worker(rank: int, world: int, cfg: Config, steps: int, out: Any) -> None:
    """Train ``steps`` steps; rank 0 reports each step's wall time (ranks start each step together)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with ParallelDims.from_config(cfg.parallel).build("cpu") as topo:
            keep_host_heap()  # as the CLI trainer's workers do on CPU
            trainer = Trainer(cfg, topo)
            times = []
            for step in range(1, steps + 1):
                topo.comm.barrier()
                t0 = time.perf_counter()
                trainer.train_step(step)
                topo.comm.barrier()
                times.append(time.perf_counter() - t0)
            if rank == 0:
                out.put(times)
    finally:
        dist.destroy_process_group()


def predict(cfg: Config, profile: str) -> tuple[float, dict[str, float]]:
    """The planner's step time and terms for this config's layout on ``world`` profiled devices."""
    p, t = cfg.parallel, cfg.train
    layout = Layout(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, zero_stage=p.zero_stage,
                    pipeline_schedule=p.pipeline_schedule, virtual_stages=p.virtual_stages,
                    sequence_parallel=p.sequence_parallel, recompute=p.recompute, micro_batch=t.micro_batch)
    work = Workload(t.global_batch, t.seq_len, t.precision, half_params=False, bucket_mb=p.bucket_mb)
    cluster = Cluster.of(gpu_spec(profile), p.world_size, gpus_per_node=p.world_size)
    report = step_cost(cfg.model, layout, work, cluster)
    return report.step_time_s, report.terms


def breakdown(cfg: Config, profile: str) -> dict[str, dict[str, float]]:
    """One single-process step under torch.profiler: measured seconds in GEMMs, attention and
    everything else, next to the cost model's GEMM, attention and element-wise terms."""
    from torch.profiler import profile as torch_profile

    from hybridpar.planner.price.cost import gemm_backward_time, gemm_time

    torch.set_num_threads(1)
    keep_host_heap()  # as the CLI trainer's workers do on CPU
    trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel).build("cpu"))
    for step in (1, 2):
        trainer.train_step(step)
    with torch_profile() as prof:
        t0 = time.perf_counter()
        trainer.train_step(3)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    mm = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm")) / 1e6
    attn = sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key) / 1e6
    m, t = cfg.model, cfg.train
    gpu = gpu_spec(profile)
    tok, h, hd = t.micro_batch * t.seq_len, m.dim, m.head_dim
    # the runtime's GEMMs: separate q, k, v, o and w1, w3, w2 projections
    shapes = [(tok, h, h), (tok, m.n_kv_heads * hd, h), (tok, m.n_kv_heads * hd, h), (tok, h, h),
              (tok, m.ffn_hidden, h), (tok, m.ffn_hidden, h), (tok, h, m.ffn_hidden)]
    per_layer = sum(gemm_time(*x, gpu, 4) + sum(gemm_backward_time(*x, gpu, 4)) for x in shapes)
    head = (tok, m.vocab_size, h)
    micro = t.global_batch // t.micro_batch
    g_pred = micro * (m.n_layers * per_layer + gemm_time(*head, gpu, 4) + sum(gemm_backward_time(*head, gpu, 4)))
    rates = gpu.calibration.attention_rates(t.seq_len, hd) if gpu.calibration else None
    flops = 4 * tok * t.seq_len * h / 2
    a_pred = micro * m.n_layers * (flops / rates[0] + 2.5 * flops / rates[1]) if rates else 0.0
    step, _ = predict(cfg, profile)
    others = sorted((e for e in events if e.key not in ("aten::mm", "aten::addmm", "aten::bmm")
                     and "scaled_dot_product" not in e.key), key=lambda e: -e.self_cpu_time_total)[:12]
    print("largest other ops: " + ", ".join(f"{e.key.removeprefix('aten::')} {e.self_cpu_time_total / 1e3:.1f} ms"
                                            f"/{e.count}" for e in others))
    return {"measured": {"step (profiled)": total, "step (wall)": wall, "gemm": mm, "attention": attn,
                         "other": total - mm - attn},
            "predicted": {"step (profiled)": step, "step (wall)": step, "gemm": g_pred, "attention": a_pred,
                          "other": step - g_pred - a_pred}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", help="hardware profile from hybridpar calibrate (default: calibrate --quick now)")
    ap.add_argument("--steps", type=int, default=6, help="steps per layout; the first is not counted")
    ap.add_argument("--repeats", type=int, default=1, help="rounds over all layouts (interleaved)")
    ap.add_argument("--only", help="comma-separated layout names to run (default: all)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also profile one single-process step: GEMM / attention / other, measured vs predicted")
    args, overrides = ap.parse_known_args()
    tmp = Path(tempfile.mkdtemp(prefix="planner-time-"))
    profile = args.profile
    if profile is None:
        profile = str(calibrate(tmp / "hardware.toml", 2, quick=True, device_name="cpu",
                                progress=lambda s: print(s, flush=True)))
    if args.breakdown:
        parts = breakdown(make_config(overrides, {}, str(tmp / "run")), profile)
        print(f"{'one dp1 step':<16} {'measured s':>10} {'predicted s':>11}")
        for k in parts["measured"]:
            print(f"{k:<16} {parts['measured'][k]:>10.3f} {parts['predicted'][k]:>11.3f}")
    chosen = [(n, lay) for n, lay in LAYOUTS if args.only is None or n in args.only.split(",")]
    load = [os.getloadavg()[0]]
    samples: dict[str, list[float]] = {name: [] for name, _ in chosen}
    for rep in range(args.repeats):  # layouts interleaved, so a neighbour's burst hits all alike
        for name, lay in chosen:
            cfg = make_config(overrides, lay, str(tmp / "run"))
            times = run_ranks(worker, cfg.parallel.world_size, cfg, args.steps)[0]
            samples[name] += times[1:]
            print(f"  round {rep + 1} {name}: median {statistics.median(times[1:]):.3f} s", flush=True)
    load.append(os.getloadavg()[0])
    rows = []
    for name, lay in chosen:
        cfg = make_config(overrides, lay, str(tmp / "run"))
        measured = statistics.median(samples[name])
        predicted, terms = predict(cfg, profile)
        rows.append({"layout": name, "world": cfg.parallel.world_size, "micro_batch": cfg.train.micro_batch,
                     "microbatches": cfg.train.global_batch // (cfg.parallel.dp * cfg.train.micro_batch),
                     "predicted_s": predicted, "measured_s": measured, "error": predicted / measured - 1,
                     "spread_s": [min(samples[name]), max(samples[name])],
                     "terms": {k: terms[k] for k in ("compute_busy", "bubble", "tp_comm", "dp_exposed", "optimizer")}})
    print(f"\ntiny preset, global batch {cfg.train.global_batch} x {cfg.train.seq_len} tokens, fp32, "
          f"one gloo process per core, median of {args.repeats} x {args.steps - 1} steps; profile {profile}; "
          f"load average {load[0]:.1f} -> {load[1]:.1f}")
    print(f"{'layout':<14} {'world':>5} {'mb':>3} {'M':>3} {'predicted s':>11} {'measured s':>10} {'error':>7}"
          f" {'min..max s':>13}  {'busy':>6} {'bubble':>6} {'tp comm':>7} {'dp exp':>6} {'optim':>6}")
    for r in rows:
        tm = r["terms"]
        print(f"{r['layout']:<14} {r['world']:>5} {r['micro_batch']:>3} {r['microbatches']:>3} "
              f"{r['predicted_s']:>11.3f} {r['measured_s']:>10.3f} {100 * r['error']:>+6.1f}% "
              f"{r['spread_s'][0]:>6.3f}..{r['spread_s'][1]:<6.3f} {tm['compute_busy']:>6.3f} {tm['bubble']:>6.3f} "
              f"{tm['tp_comm']:>7.3f} {tm['dp_exposed']:>6.3f} {tm['optimizer']:>6.3f}")
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst |error| {100 * worst:.1f}% (target <= 30%)")
    print(json.dumps({"benchmark": "planner_time", "profile": profile, "steps": args.steps, "repeats": args.repeats,
                      "load_average": load, "rows": rows,
                      "worst_abs_error": worst, "target": 0.30}))


if __name__ == "__main__":
    main()
