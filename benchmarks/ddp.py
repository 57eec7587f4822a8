"""Data parallel dp=2: hybridpar's bucketed reducer vs torch DistributedDataParallel, side by side.

Two gloo processes each hold both models (same weights, same AdamW, same micro-batches,
same bucket size, same clipping and loss logging) and alternate steps between them, so noise
hits both alike. Reports the ratio of median step times (target <= 1.05) and checks that the
per-step losses agree.

    python benchmarks/ddp.py [--steps 20] [--section.key value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _spawn import run_ranks
from torch.nn.parallel import DistributedDataParallel

from hybridpar.config import load_config
from hybridpar.distributed.device import keep_host_heap
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.models.llama import Llama
from hybridpar.training.optim import build_optimizer, lr_at
from hybridpar.training.trainer import Trainer


def ddp_step(model: DistributedDataParallel, opt: torch.optim.Optimizer, batches, step: int, cfg) -> float:
    for g in opt.param_groups:
        g["lr"] = lr_at(step, cfg.train)
    opt.zero_grad(set_to_none=False)
    losses = []
    for i, (x, y) in enumerate(batches):
        ctx = model.no_sync() if i < len(batches) - 1 else contextlib.nullcontext()
        with ctx:
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            (loss / len(batches)).backward()
        losses.append(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
    opt.step()
    mean = torch.stack(losses).mean()
    dist.all_reduce(mean)
    return float(mean) / dist.get_world_size()


def worker(rank: int, world: int, steps: int, overrides: list[str], out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_config(None, ["--parallel.dp", str(world), *overrides])
    with ParallelDims.from_config(cfg.parallel).build("cpu") as topo:
        keep_host_heap()  # as the CLI trainer's workers do on CPU
        ours = Trainer(cfg, topo)
        ref = Llama(cfg.model)
        ref.init_weights(cfg.train.seed)
        ddp = DistributedDataParallel(ref, bucket_cap_mb=cfg.parallel.bucket_mb)
        opt = build_optimizer(ref, cfg.train)
        times: dict[str, list[float]] = {"hybridpar": [], "ddp": []}
        losses: dict[str, list[float]] = {"hybridpar": [], "ddp": []}
        for step in range(1, steps + 1):
            batches = ours.micro_batches(step, cfg.train.global_batch, ours.train_data)
            dist.barrier()
            t0 = time.perf_counter()
            losses["hybridpar"].append(ours.train_step(step).loss)
            t1 = time.perf_counter()
            losses["ddp"].append(ddp_step(ddp, opt, batches, step, cfg))
            t2 = time.perf_counter()
            if step > 2:  # warm-up
                times["hybridpar"].append(t1 - t0)
                times["ddp"].append(t2 - t1)
    if rank == 0:
        out.put({"times": times, "losses": losses, "params": cfg.model.num_params(),
                 "batch": f"{cfg.train.global_batch}x{cfg.train.seq_len}", "micro": cfg.train.micro_batch})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--world", type=int, default=2)
    args, overrides = ap.parse_known_args()
    (res,) = run_ranks(worker, args.world, args.steps, overrides)
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    ratio = med["hybridpar"] / med["ddp"]
    max_diff = max(abs(a - b) / abs(b) for a, b in zip(res["losses"]["hybridpar"], res["losses"]["ddp"], strict=True))
    print(f"dp={args.world} gloo, {res['params'] / 1e6:.2f}M params, batch {res['batch']}, micro {res['micro']}")
    print(f"{'loop':<12}{'median step (ms)':>18}{'min (ms)':>12}{'steps':>8}")
    for k, v in res["times"].items():
        print(f"{k:<12}{1e3 * statistics.median(v):>18.1f}{1e3 * min(v):>12.1f}{len(v):>8}")
    print(f"ratio hybridpar / DDP = {ratio:.3f} (target <= 1.05); max relative loss difference {max_diff:.2e}")
    print(json.dumps({"benchmark": "ddp", "world": args.world, "ratio": round(ratio, 4), "target": 1.05,
                      "max_rel_loss_diff": max_diff, "median_step_s": {k: round(v, 5) for k, v in med.items()}}))


if __name__ == "__main__":
    main()
