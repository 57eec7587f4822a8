"""Single-process overhead: hybridpar's training step vs a plain PyTorch loop, side by side.

Both train the same Llama model with the same AdamW settings, micro-batching and clipping on
the built-in corpus. Steps alternate between the two in rounds, so machine noise hits both
alike; the reported number is the ratio of median step times (target <= 0.97: the fused optimizer,
foreach norm and clipping, and gradients stored rather than added to zeros must beat the loop a
user writes; the model's forward and backward, ~97% of the step at the demo shape, are the same).

``--compile``: hybridpar runs with ``train.compile = true`` (each block compiled by inductor)
against the same plain eager loop; target <= 0.85 (compiling must beat the hand-written loop,
not only match it). A third loop, the plain one with the same regional ``torch.compile`` of its
blocks, shows how much of the gain is the compiler's (ours / plain compiled should be ~1).
Compile time is not in the timed steps (three warm-up steps each); it is printed.

    python benchmarks/overhead.py [--compile] [--steps 30] [--rounds 3] [--section.key value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridpar.config import load_config
from hybridpar.data.corpus import load_tokens
from hybridpar.distributed import device as devices
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.models.llama import Llama
from hybridpar.training.optim import lr_at
from hybridpar.training.precision import autocast
from hybridpar.training.trainer import Trainer


class PlainLoop:
    """What a user would write by hand: model, AdamW, random windows, clip, step."""

    def __init__(self, cfg, device: torch.device, compile_blocks: bool = False) -> None:
        t = cfg.train
        self.cfg, self.device = cfg, device
        self.model = Llama(cfg.model).to(device)
        self.model.init_weights(t.seed)
        if compile_blocks:  # the regional compilation a user would write: each block's forward
            for block in self.model.layers:
                block.forward = torch.compile(block.forward)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        rest = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
        self.tokens = torch.from_numpy(load_tokens(t.data).train.astype("int64"))
        self.gen = torch.Generator().manual_seed(t.seed)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.cfg.train
        starts = torch.randint(0, len(self.tokens) - t.seq_len - 1, (t.micro_batch,), generator=self.gen)
        rows = torch.stack([self.tokens[s : s + t.seq_len + 1] for s in starts.tolist()])
        rows = rows.to(self.device)
        return rows[:, :-1], rows[:, 1:]

    def step(self, step: int) -> float:
        t = self.cfg.train
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step, t)
        self.opt.zero_grad(set_to_none=False)
        accum = t.global_batch // t.micro_batch
        total = 0.0
        for _ in range(accum):
            x, y = self.batch()
            with autocast(t.precision, self.device):
                logits = self.model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            (loss / accum).backward()
            total += loss.item() / accum
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        self.opt.step()
        return total


def timed(fn, step: int, device: torch.device) -> float:
    devices.synchronize(device)
    t0 = time.perf_counter()
    fn(step)
    devices.synchronize(device)
    return time.perf_counter() - t0


def build_loops(cfg, device: torch.device, compiled: bool) -> dict[str, Callable[[int], float]]:
    """The loops compared, by name: hybridpar's ``Trainer.train_step`` (``cfg`` decides whether it
    compiles), the plain eager loop and, with ``compiled``, the plain loop with regional compile."""
    if device.type == "cpu":
        devices.keep_host_heap()  # as the CLI trainer's workers do on CPU
    loops = {"hybridpar": Trainer(cfg, ParallelDims.from_config(cfg.parallel).build(device.type), device).train_step,
             "plain": PlainLoop(cfg, device).step}
    if compiled:
        loops["plain_compiled"] = PlainLoop(cfg, device, compile_blocks=True).step
    return loops


def compare_loops(loops: dict[str, Callable[[int], float]], device: torch.device, steps: int,
                  rounds: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Warm each loop up (three steps, compiling if it does), then time them interleaved step by
    step for ``rounds`` x ``steps``: (step times per loop, warm-up seconds per loop)."""
    warm: dict[str, float] = {}
    for name, fn in loops.items():  # warm-up (and compile) each
        start = time.perf_counter()
        for s in range(1, 4):
            fn(s)
        warm[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {k: [] for k in loops}
    step = 4
    for _ in range(rounds):
        for _ in range(steps):  # interleave step by step
            for name, fn in loops.items():
                times[name].append(timed(fn, step, device))
            step += 1
    return times, warm


def mfu_of(cfg, device: torch.device, med: dict[str, float]) -> tuple[dict[str, float], str]:
    """Each loop's MFU from its median step time, and where the peak came from."""
    t = cfg.train
    peak, peak_name = devices.peak_flops(device, t.precision)
    tokens = t.global_batch * t.seq_len
    return {k: cfg.model.flops_per_token(t.seq_len) * tokens / v / peak for k, v in med.items()}, peak_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per side per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="hybridpar with train.compile = true (target <= 0.85)")
    args, overrides = ap.parse_known_args()
    if args.compile:
        overrides = [*overrides, "--train.compile", "true"]
    cfg = load_config(None, overrides)
    torch.manual_seed(cfg.train.seed)
    device = devices.pick_device(cfg.train.device)
    times, warm = compare_loops(build_loops(cfg, device, args.compile), device, args.steps, args.rounds)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["hybridpar"] / med["plain"]
    target = 0.85 if args.compile else 0.97
    mfu, peak_name = mfu_of(cfg, device, med)
    t = cfg.train
    print(f"device {device} ({peak_name}); MFU " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in mfu.items()))
    print(f"model {cfg.model.preset} ({cfg.model.num_params() / 1e6:.2f}M params), batch {t.global_batch}x{t.seq_len}, "
          f"micro {t.micro_batch}, {t.precision}, torch threads {torch.get_num_threads()}"
          + (", hybridpar compiled (train.compile = true)" if args.compile else ""))
    print(f"{'loop':<16}{'median step (ms)':>18}{'min (ms)':>12}{'steps':>8}{'warm-up 3 steps (s)':>22}")
    for k, v in times.items():
        print(f"{k:<16}{1e3 * statistics.median(v):>18.1f}{1e3 * min(v):>12.1f}{len(v):>8}{warm[k]:>22.1f}")
    print(f"ratio hybridpar / plain = {ratio:.3f} (target <= {target})")
    extra = {}
    if args.compile:
        extra = {"ratio_vs_plain_compiled": round(med["hybridpar"] / med["plain_compiled"], 4)}
        print(f"ratio hybridpar / plain compiled = {extra['ratio_vs_plain_compiled']:.3f}")
    print(json.dumps({"benchmark": "overhead", "compile": args.compile, "ratio": round(ratio, 4), "target": target,
                      **extra, "median_step_s": {k: round(v, 5) for k, v in med.items()}, "steps": len(times["plain"]),
                      "warmup_s": {k: round(v, 2) for k, v in warm.items()},
                      "device": str(device), "mfu": {k: round(v, 4) for k, v in mfu.items()}}))


if __name__ == "__main__":
    main()
