"""Context parallelism on gloo: hybridpar's ring, Ulysses and hybrid (USP) attention vs a naive
all-gather-K/V context parallel.

For each cp in --cps a world of cp processes trains the tiny model on one long sequence (zigzag
shards) with every attention core side by side: same weights, same AdamW, gradients averaged over
cp by the same bucketed reducer, steps alternating so noise hits all alike. ``hybridpar`` is ring
attention (``cp_mode = "ring"``), ``ulysses`` the all-to-all of heads (``cp_mode = "ulysses"``),
``hybrid`` Ulysses pairs with ring across (``cp_mode = "hybrid"``, ``cp_ulysses = 2``; cp >= 4). The naive core
all-gathers K and V over cp (backward: reduce-scatter of dK, dV) and runs the fused attention
kernel on the whole sequence with a position mask. Reported per cp:

* step-time ratio of each mode / naive (median of the timed steps), of Ulysses and hybrid / ring
  (``vs ring``, same sequence), and the max loss difference;
* per-rank peak live tensor bytes over one step: storages created during the step that are alive
  at an op boundary (a dispatch mode tracks them; parameters, gradients and optimizer state,
  identical in both, are excluded and reported once as "static");
* counted bytes per step on the cp axis (attention traffic + the shared gradient all-reduce);
* the longest sequence that fits a fixed per-rank budget (default: what hybridpar needs at
  cp = 1 for --seq), from peak bytes measured at seq/4, seq/2 and seq (exact quadratic fit).

    python benchmarks/cp.py [--seq 4096] [--steps 4] [--cps 2,4] [--budget-mib M]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _spawn import run_ranks
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hybridpar.config import model_preset
from hybridpar.distributed.mesh import Axis, ParallelDims
from hybridpar.models.llama import FAMILY, Llama
from hybridpar.parallel.context import positions_table, zigzag_positions, zigzag_shard
from hybridpar.parallel.context_model import enable_context_parallel
from hybridpar.parallel.zero import GradientReducer

MIB = 2**20


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created under the mode and alive at an op boundary."""

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        super().__init__()
        self.exclude = {StorageWeakRef(t.untyped_storage()).cdata for t in exclude}
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.exclude and ref.cdata not in self.refs:
                    self.refs[ref.cdata] = (ref, t.untyped_storage().nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.refs.values()))
        return out


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim 2) over cp; backward reduce-scatter (sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.axis = axis
        return axis.comm.all_gather(x.contiguous(), axis, dim=2)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.axis.comm.reduce_scatter(dy.contiguous(), ctx.axis, dim=2), None


class NaiveCore:
    """The baseline attention core: every rank gathers the whole sequence's K/V and masks by
    position. Installed on each attention module in place of the ring core that
    ``enable_context_parallel`` put there (``module.core = NaiveCore(...)``), so projections,
    RoPE and everything around the core are the same code in both runners. The additive mask
    ``[T / cp, T]`` is built once per length and shared by all layers."""

    def __init__(self, axis: Axis, masks: dict[int, torch.Tensor]) -> None:
        self.axis = axis
        self.masks = masks

    def mask(self, seq_len: int) -> torch.Tensor:
        axis = self.axis
        if seq_len not in self.masks:
            self.masks.clear()
            table = positions_table(seq_len, axis.size)
            visible = table[axis.rank][:, None] >= table.flatten()[None, :]
            self.masks[seq_len] = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        return self.masks[seq_len]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Any = None) -> torch.Tensor:
        if docs is not None:
            raise NotImplementedError("the naive baseline core takes single sequences only")
        axis = self.axis
        t = q.shape[2]  # [B, heads, T / cp, head_dim], RoPE already applied
        k, v = _GatherSequence.apply(k, axis), _GatherSequence.apply(v, axis)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(t * axis.size),
                                              enable_gqa=q.shape[1] != k.shape[1])


class Runner:
    """One attention core's model, optimizer and cp gradient reducer on this rank."""

    def __init__(self, cfg, axis: Axis, naive: bool, ulysses: tuple[Axis, Axis] | None = None) -> None:  # noqa: ANN001
        self.model = Llama(cfg)
        self.model.init_weights(0)
        cp = enable_context_parallel(self.model, axis, cores=FAMILY.attention_modules(self.model), ulysses=ulysses)
        if naive:  # same hook, layout and positions check; only the core differs
            masks: dict[int, torch.Tensor] = {}
            for module in cp.modules:
                module.core = NaiveCore(axis, masks)
        self.axis = axis
        self.params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=1e-3)
        self.reducer = GradientReducer(self.params, axis, 25 * MIB)

    def step(self, tokens: torch.Tensor) -> float:
        seq = tokens.shape[1] - 1
        x, y = zigzag_shard(tokens[:, :-1], self.axis), zigzag_shard(tokens[:, 1:], self.axis)
        self.opt.zero_grad(set_to_none=False)
        logits = self.model(x, zigzag_positions(seq, self.axis))
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())  # mean over local tokens
        loss.backward()
        self.reducer.finish()
        self.opt.step()
        return float(self.axis.comm.all_reduce(loss.detach(), self.axis, op="avg"))

    def static(self) -> list[torch.Tensor]:
        state = [t for s in self.opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return [*self.params, *(p.grad for p in self.params if p.grad is not None), *state,
                *(b.buffer for b in self.reducer.buckets)]


def _tokens(seq: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, seq + 1), generator=torch.Generator().manual_seed(seq))


def worker(rank: int, world: int, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = dataclasses.replace(model_preset("tiny"), max_seq_len=args.seq)
    with ParallelDims(cp=world).build() as topo:
        runners = {"hybridpar": Runner(cfg, topo.cp, False), "naive": Runner(cfg, topo.cp, True)}
        for name, u in modes(world):  # Ulysses over all of cp, hybrid: Ulysses pairs, ring across
            runners[name] = Runner(cfg, topo.cp, False, topo.split_axis(topo.cp, u, ("cp.ulysses", "cp.ring")))
        times: dict[str, list[float]] = {k: [] for k in runners}
        losses: dict[str, list[float]] = {k: [] for k in runners}
        counted: dict[str, dict] = {}
        tokens = _tokens(args.seq)
        for step in range(args.steps + 1 if world > 1 else 1):
            for name, r in runners.items():
                topo.comm.barrier(topo.cp)
                topo.comm.counter.reset()
                t0 = time.perf_counter()
                losses[name].append(r.step(tokens))
                if step > 0:  # step 0 warms up
                    times[name].append(time.perf_counter() - t0)
                counted[name] = topo.comm.counter.snapshot()
        peaks: dict[str, dict[int, int]] = {k: {} for k in runners}
        for seq in (args.seq // 4, args.seq // 2, args.seq):
            for name, r in runners.items():
                topo.comm.barrier(topo.cp)
                with LiveBytes(r.static()) as mode:
                    r.step(_tokens(seq))
                peaks[name][seq] = mode.peak
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in runners["hybridpar"].static()}
        static = sum(storages.values())
        out.put({"rank": rank, "times": times, "losses": losses, "counted": counted, "peaks": peaks,
                 "static": static})
    if world > 1:
        dist.destroy_process_group()


def modes(cp: int) -> list[tuple[str, int]]:
    """The Ulysses runners at ``cp`` and their Ulysses degree: ulysses (cp), hybrid (2; cp >= 4)."""
    return ([("ulysses", cp)] if cp > 1 else []) + ([("hybrid", 2)] if cp >= 4 else [])


def run_world(world: int, args: argparse.Namespace) -> list[dict]:
    return sorted(run_ranks(worker, world, args, expect=world), key=lambda r: r["rank"])


def max_seq(peaks: dict[int, int], static: int, budget: int, cp: int) -> int:
    """Longest multiple of 2cp whose fitted peak + static fits ``budget``."""
    xs = np.array(sorted(peaks), float)
    ys = np.array([peaks[int(x)] for x in xs], float)
    a = np.polyfit(xs, ys, 2)
    if a[0] < 0:  # linear up to measurement noise: a concave fit would never reach the budget;
        a = np.polyfit(xs[-2:], ys[-2:], 1)  # use the line through the two longest
    lo, hi = 0, 1 << 24
    while lo < hi:  # largest n with fit(2cp * n) + static <= budget
        mid = (lo + hi + 1) // 2
        if np.polyval(a, 2 * cp * mid) + static <= budget:
            lo = mid
        else:
            hi = mid - 1
    return 2 * cp * lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cps", default="2,4")
    ap.add_argument("--budget-mib", type=float, default=0.0, help="0: hybridpar's need at cp=1 for --seq")
    args = ap.parse_args()
    cps = [int(c) for c in args.cps.split(",")]
    results = {cp: run_world(cp, args) for cp in [1, *cps]}
    static = results[1][0]["static"]
    budget = int(args.budget_mib * MIB) or static + results[1][0]["peaks"]["hybridpar"][args.seq]
    rows = []
    for cp in [1, *cps]:
        res = results[cp]
        row: dict[str, Any] = {"cp": cp}
        for name in ("hybridpar", "naive", *(n for n, _ in modes(cp))):
            peak = max(r["peaks"][name][args.seq] for r in res)
            counted = res[0]["counted"][name]
            attn = sum(v["wire_bytes"] for k, v in counted.items() if not k.startswith("all_reduce"))
            row[name] = {"median_step_s": statistics.median(res[0]["times"][name]) if cp > 1 else None,
                         "peak_live_mib": peak / MIB, "attn_wire_mib": attn / MIB,
                         "total_wire_mib": sum(v["wire_bytes"] for v in counted.values()) / MIB,
                         "max_seq_in_budget": min(max_seq(r["peaks"][name], r["static"], budget, cp) for r in res)}
        if cp > 1:
            row["step_time_ratio"] = row["hybridpar"]["median_step_s"] / row["naive"]["median_step_s"]
            row["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(
                res[0]["losses"]["hybridpar"], res[0]["losses"]["naive"], strict=True))
            for name, _ in modes(cp):  # against naive, like ring; and against ring at the same sequence
                row[name]["step_time_ratio"] = row[name]["median_step_s"] / row["naive"]["median_step_s"]
                row[name]["vs_ring"] = row[name]["median_step_s"] / row["hybridpar"]["median_step_s"]
                row[name]["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(
                    res[0]["losses"][name], res[0]["losses"]["naive"], strict=True))
        rows.append(row)
    print(f"tiny model ({model_preset('tiny').num_params() / 1e6:.2f}M params), one sequence of {args.seq} tokens, "
          f"gloo, zigzag layout; static (params + grads + AdamW) {static / MIB:.1f} MiB per rank; "
          f"budget {budget / MIB:.1f} MiB per rank")
    print(f"{'cp':>3} {'core':<10}{'step (s)':>9}{'ratio':>7}{'vs ring':>8}{'peak live MiB':>15}{'attn wire MiB':>15}"
          f"{'total wire MiB':>16}{'max seq in budget':>19}")
    for row in rows:
        for name in ("hybridpar", "naive", *(n for n, _ in modes(row["cp"]))):
            m = row[name]
            step = f"{m['median_step_s']:.2f}" if m["median_step_s"] else "-"
            ratio = f"{row['step_time_ratio']:.3f}" if name == "hybridpar" and "step_time_ratio" in row else ""
            ratio = f"{m['step_time_ratio']:.3f}" if "step_time_ratio" in m else ratio
            vs_ring = f"{m['vs_ring']:.3f}" if "vs_ring" in m else ""
            print(f"{row['cp']:>3} {name:<10}{step:>9}{ratio:>7}{vs_ring:>8}{m['peak_live_mib']:>15.1f}{m['attn_wire_mib']:>15.2f}"
                  f"{m['total_wire_mib']:>16.2f}{m['max_seq_in_budget']:>19}")
    print(json.dumps({"benchmark": "cp", "seq": args.seq, "budget_mib": round(budget / MIB, 2),
                      "static_mib": round(static / MIB, 2), "rows": rows}, default=lambda x: round(x, 4)))


if __name__ == "__main__":
    main()
