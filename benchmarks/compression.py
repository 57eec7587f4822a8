"""INT8 gradient compression on the demo: loss and step time vs uncompressed, side by side.

Every process builds two trainers of the same run (``hybridpar train``'s built-in demo by
default: tiny Llama, dp2 x tp2 x pp2, 300 steps), one with ``parallel.grad_compression =
"none"`` and one with ``"int8"``, and steps them in turn (the order alternating each step), so
noise hits both alike. Reported:

* the training loss at the last step and the mean of the last 10 steps (same batches for both),
  the gap int8 vs none (target: within 1%), and the validation loss at the end;
* the data-parallel wire bytes per step (ring model, from the comm counter: the gradient
  collectives on the dp axis) and their ratio (goal about 4x);
* the median step time of each and the ratio int8 / none.

Gloo on CPU: the quantisation costs compute on the same cores the collectives use, and the
demo's dp traffic is small, so the time ratio here says what compression costs, not what it
saves on a bandwidth-bound network.

    python benchmarks/compression.py [--steps 300] [--stage 0] [--section.key value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch.distributed as dist
from _spawn import run_ranks

from hybridpar.cli import DEMO_LAYOUT
from hybridpar.config import load_config
from hybridpar.distributed.device import keep_host_heap
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.training.trainer import Trainer

MODES = ("none", "int8")


def worker(rank: int, world: int, steps: int, overrides: list[str], out) -> None:  # noqa: ANN001
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tmp = tempfile.mkdtemp(prefix="hybridpar-compression-") if rank == 0 else ""
    cfgs = {m: load_config(None, [*overrides, "--train.steps", str(steps), "--train.run_dir", f"{tmp}/{m}",
                                  "--parallel.grad_compression", m]) for m in MODES}
    with ParallelDims.from_config(cfgs["none"].parallel).build("cpu") as topo:
        keep_host_heap()  # as the CLI trainer's workers do on CPU
        trainers = {m: Trainer(cfgs[m], topo) for m in MODES}
        counter = topo.comm.counter
        losses: dict[str, list[float]] = {m: [] for m in MODES}
        times: dict[str, list[float]] = {m: [] for m in MODES}
        wire: dict[str, list[int]] = {m: [] for m in MODES}
        for step in range(1, steps + 1):
            for m in MODES if step % 2 else MODES[::-1]:
                before = counter.wire_bytes(axis=topo.dp_cp.name)
                topo.comm.barrier()
                t0 = time.perf_counter()
                losses[m].append(trainers[m].train_step(step).loss)
                times[m].append(time.perf_counter() - t0)
                wire[m].append(counter.wire_bytes(axis=topo.dp_cp.name) - before)
        val = {m: trainers[m].evaluate() for m in MODES}
        if rank == 0:
            out.put({"losses": losses, "times": times, "wire": wire, "val": val, "axis": topo.dp_cp.name,
                     "layout": str(cfgs["none"].parallel.world_size) + " ranks"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    args, overrides = ap.parse_known_args()
    overrides = [*DEMO_LAYOUT, *overrides]
    cfg = load_config(None, overrides)
    (res,) = run_ranks(worker, cfg.parallel.world_size, args.steps, overrides)
    warm = slice(min(5, args.steps - 1), None)  # the first steps warm caches up
    med = {m: statistics.median(res["times"][m][warm]) for m in MODES}
    last = {m: res["losses"][m][-1] for m in MODES}
    tail = {m: statistics.fmean(res["losses"][m][-10:]) for m in MODES}
    wire = {m: statistics.median(res["wire"][m]) for m in MODES}
    p = cfg.parallel
    print(f"demo layout dp{p.dp} tp{p.tp} pp{p.pp} cp{p.cp}, zero stage {p.zero_stage}, {args.steps} steps, "
          f"gloo on CPU; dp traffic = wire bytes on axis {res['axis']!r} per step")
    print(f"{'mode':<6}{'loss@last':>11}{'mean last 10':>14}{'val loss':>10}{'dp wire KB':>12}{'median ms':>11}")
    for m in MODES:
        print(f"{m:<6}{last[m]:>11.4f}{tail[m]:>14.4f}{res['val'][m]:>10.4f}{wire[m] / 1e3:>12.1f}"
              f"{1e3 * med[m]:>11.1f}")
    summary = {
        "steps": args.steps, "overrides": overrides, "loss_last": last, "loss_last10": tail, "val_loss": res["val"],
        "loss_gap_rel": (last["int8"] - last["none"]) / last["none"],
        "loss_last10_gap_rel": (tail["int8"] - tail["none"]) / tail["none"],
        "val_gap_rel": (res["val"]["int8"] - res["val"]["none"]) / res["val"]["none"],
        "dp_wire_bytes_per_step": wire, "wire_ratio_none_over_int8": wire["none"] / wire["int8"],
        "median_step_s": med, "time_ratio_int8_over_none": med["int8"] / med["none"],
    }
    print(f"int8 vs none: loss at step {args.steps} {100 * summary['loss_gap_rel']:+.3f}% (target within 1%), "
          f"last-10 mean {100 * summary['loss_last10_gap_rel']:+.3f}%, val {100 * summary['val_gap_rel']:+.3f}%; "
          f"dp bytes / {summary['wire_ratio_none_over_int8']:.2f}; step time x {summary['time_ratio_int8_over_none']:.3f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
