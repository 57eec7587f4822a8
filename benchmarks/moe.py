"""Expert parallelism on gloo: hybridpar's MoE layer vs a plain all-to-all implementation, on
balanced and on real (unbalanced) routing, side by side.

1. Real routing: ``tiny-moe`` (8 experts, top-2) trains ``--train-steps`` steps on the built-in
   corpus in one process; the inputs of MoE layer ``--layer`` on fresh batches and that layer's
   trained router and experts are kept.
2. For each ep in ``--eps``, ``ep`` gloo processes each take their share of those tokens and run
   the layer's experts (forward + backward) two ways on both routings: every step runs all four
   (orders alternating), so noise hits them alike:

   * ours: :class:`hybridpar.parallel.experts.ExpertParallel` (counts all-to-all, one variable-
     split all-to-all each way, the experts on the rows as they arrive, counted traffic);
   * plain: what one writes with ``torch.distributed`` only: the same dispatch with
     ``torch.distributed.nn.functional.all_to_all_single`` (autograd-aware) and a loop over the
     local experts (as Hugging Face's Mixtral block computes them).

   Each on (a) forced balanced routing (slot ``j`` of token ``i`` goes to expert ``(i k + j) mod
   E``, weights ``1/k``) and (b) the trained router's top-k on the real tokens.

Reported per (ep, routing): median step time of each (a step's time is its slowest rank's) and
the ratio ours / plain (target <= 1.0): the median over steps of the two runs made back to back in
that step (paired, so slow phases of the machine hit both; ``ratio_of_medians`` is also kept),
all-to-all wire bytes per rank per step (ours from the counter, plain from its splits), the
imbalance (max / mean tokens per expert, and the busiest rank's rows over the mean), and the
slowdown of real over balanced routing. Outputs of the two implementations are compared
(max abs difference).

    python benchmarks/moe.py [--train-steps 200] [--eps 2,4] [--steps 40] [--tokens 4096]
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
import torch.nn.functional as F
from _spawn import run_ranks
from torch import Tensor

from hybridpar.config import load_config
from hybridpar.distributed.device import keep_host_heap
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.models.moe import moe_layers
from hybridpar.parallel.experts import ExpertParallel


def trained_layer(train_steps: int, layer: int, tokens: int, run_dir: Path) -> dict[str, Tensor]:
    """Train tiny-moe in this process; return layer ``layer``'s weights and real inputs."""
    from hybridpar.training.trainer import Trainer

    cfg = load_config(None, ["--model.preset", "tiny-moe", "--train.steps", str(train_steps),
                             "--train.run_dir", str(run_dir), "--train.seq_len", "128",
                             "--train.global_batch", "16", "--train.micro_batch", "16"])
    keep_host_heap()  # as the CLI trainer's workers do on CPU
    with ParallelDims().build("cpu") as topo:
        trainer = Trainer(cfg, topo)
        for step in range(1, train_steps + 1):
            trainer.train_step(step)
        moe = moe_layers(trainer.model)[layer]
        captured: list[Tensor] = []
        hook = moe.register_forward_pre_hook(lambda _m, args: captured.append(args[0].detach().reshape(-1, args[0].shape[-1])))
        with torch.no_grad():
            n = 0
            step = train_steps + 1
            while n < tokens:
                for x, _y, *_ in trainer.micro_batches(step, cfg.train.global_batch, trainer.train_data):
                    trainer.model(x)
                    n += x.numel()
                step += 1
        hook.remove()
        x = torch.cat(captured)[:tokens].contiguous()
        e = moe.experts
        return {"x": x, "router": moe.router.weight.detach().clone(), "w1": e.w1.detach().clone(),
                "w3": e.w3.detach().clone(), "w2": e.w2.detach().clone(),
                "k": torch.tensor(cfg.model.experts_per_token)}


def routing(kind: str, x: Tensor, router: Tensor, k: int, n_experts: int, offset: int) -> tuple[Tensor, Tensor]:
    """``(weights, idx)`` ``[N, k]``: balanced round robin, or the trained router's top-k."""
    n = x.shape[0]
    if kind == "balanced":
        slots = (torch.arange(n)[:, None] + offset) * k + torch.arange(k)[None, :]
        return torch.full((n, k), 1.0 / k), slots % n_experts
    scores = F.linear(x, router).float().softmax(-1)
    top = scores.topk(k, dim=-1)
    return top.values / top.values.sum(-1, keepdim=True), top.indices


def plain(x: Tensor, weights: Tensor, idx: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, n_experts: int,
          ep: int, rank: int) -> tuple[Tensor, int]:
    """The plain torch.distributed EP layer: sort by expert, all-to-all (autograd-aware), loop over
    local experts, all-to-all back, weighted sum. Returns (output, wire bytes sent)."""
    import warnings

    with warnings.catch_warnings():  # deprecated in favour of a private module; the public one is the baseline
        warnings.simplefilter("ignore", FutureWarning)
        from torch.distributed.nn.functional import all_to_all_single

    per, k = n_experts // ep, idx.shape[1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    counts = torch.bincount(flat, minlength=n_experts)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)  # [source, local expert] blocks
    send = counts.view(ep, per).sum(1).tolist()
    recv_blocks = recv_counts.view(ep, per)
    recv = recv_blocks.sum(1).tolist()
    rows = x[token]
    got = all_to_all_single(torch.empty(sum(recv), x.shape[1]), rows, recv, send)
    outs = torch.empty_like(got)
    starts = torch.tensor([0, *recv]).cumsum(0).tolist()
    pieces: list[tuple[Tensor, Tensor]] = []
    for e in range(per):  # each local expert over its rows from every source
        sel = torch.cat([torch.arange(starts[s] + int(recv_blocks[s, :e].sum()),
                                      starts[s] + int(recv_blocks[s, :e + 1].sum())) for s in range(ep)])
        h = got[sel]
        pieces.append((sel, F.linear(F.silu(F.linear(h, w1[e])) * F.linear(h, w3[e]), w2[e])))
    outs = torch.zeros_like(got).index_put((torch.cat([s for s, _ in pieces]),), torch.cat([y for _, y in pieces]))
    back = all_to_all_single(torch.empty(sum(send), x.shape[1]), outs, send, recv)
    out = torch.zeros_like(x).index_add(0, token, back * weights.reshape(-1)[order, None])
    row = x.shape[1] * x.element_size()
    # forward: dispatch sends ``send`` rows, combine sends back ``recv``; backward reverses both
    return out, 2 * row * (sum(send) - send[rank] + sum(recv) - recv[rank])


def worker(rank: int, world: int, data_path: str, steps: int, out: Any) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # one intra-op thread per rank where cores allow: oversubscribed OpenMP threads spin against
    # each other and make both layers' times erratic (the comparison, not either layer, is measured)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(0)
    data = torch.load(data_path, weights_only=True)
    k, n_experts = int(data["k"]), data["w1"].shape[0]
    x_all = data["x"]
    share = x_all.shape[0] // world
    x_local = x_all[rank * share:(rank + 1) * share]
    per = n_experts // world
    mine = slice(rank * per, (rank + 1) * per)
    rows: dict[str, Any] = {}
    kinds = ("balanced", "real")
    with ParallelDims(dp=world, ep=world).build("cpu") as topo:
        ours = ExpertParallel(data["w1"], data["w3"], data["w2"], n_experts, topo.tp, topo.ep, False)
        w = {n: data[n][mine].clone().requires_grad_() for n in ("w1", "w3", "w2")}
        routed = {kind: routing(kind, x_local, data["router"], k, n_experts, rank * share) for kind in kinds}
        dy = torch.randn_like(x_local)
        times = {(kind, name): [] for kind in kinds for name in ("ours", "plain")}
        wire: dict[tuple[str, str], int] = {}
        diff = dict.fromkeys(kinds, 0.0)
        # every step runs both routings and both layers, the orders alternating, so a slow phase
        # of the machine hits all four alike
        for step in range(steps + 2):
            for kind in kinds if step % 2 == 0 else kinds[::-1]:
                weights, idx = routed[kind]
                ys = {}
                for name in ("ours", "plain") if (step // 2) % 2 == 0 else ("plain", "ours"):
                    xi = x_local.clone().requires_grad_()
                    dist.barrier()
                    before = topo.comm.counter.wire_bytes("all_to_all")
                    t0 = time.perf_counter()
                    if name == "ours":
                        y = ours(xi.unsqueeze(0), weights.unsqueeze(0), idx.unsqueeze(0)).squeeze(0)
                    else:
                        y, plain_wire = plain(xi, weights, idx, w["w1"], w["w3"], w["w2"], n_experts, world, rank)
                    y.backward(dy)
                    elapsed = time.perf_counter() - t0
                    # forward and backward (ours: counts included, from the counter)
                    wire[kind, name] = topo.comm.counter.wire_bytes("all_to_all") - before if name == "ours" else plain_wire
                    if step >= 2:  # warm-up
                        times[kind, name].append(elapsed)
                    ys[name] = y.detach()
                diff[kind] = max(diff[kind], float((ys["ours"] - ys["plain"]).abs().max()))
                ours.zero_grad(set_to_none=True)
                for t in w.values():
                    t.grad = None
        per_step = {key: torch.tensor(v) for key, v in times.items()}
        for t in per_step.values():  # the slowest rank bounds each step
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        for kind in kinds:
            counts = torch.bincount(routed[kind][1].reshape(-1), minlength=n_experts).double()
            dist.all_reduce(counts)
            per_rank = counts.view(world, per).sum(1)
            med = {name: statistics.median(per_step[kind, name].tolist()) for name in ("ours", "plain")}
            paired = statistics.median((per_step[kind, "ours"] / per_step[kind, "plain"]).tolist())
            rows[kind] = {"ours_s": med["ours"], "plain_s": med["plain"], "ratio": paired,
                          "ratio_of_medians": med["ours"] / med["plain"], "ours_wire_bytes": wire[kind, "ours"],
                          "plain_wire_bytes": wire[kind, "plain"], "max_abs_diff": diff[kind],
                          "expert_imbalance": float(counts.max() / counts.mean()),
                          "rank_imbalance": float(per_rank.max() / per_rank.mean())}
        # real over balanced, paired the same way (ours)
        rows["real_over_balanced_paired"] = statistics.median(
            (per_step["real", "ours"] / per_step["balanced", "ours"]).tolist())
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train-steps", type=int, default=200)
    ap.add_argument("--layer", type=int, default=3)
    ap.add_argument("--eps", default="2,4")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of the global batch (split over ep)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = trained_layer(args.train_steps, args.layer, args.tokens, Path(tmp) / "run")
        path = str(Path(tmp) / "layer.pt")
        torch.save(data, path)
        results = {}
        for ep in [int(e) for e in args.eps.split(",")]:
            (results[ep],) = run_ranks(worker, ep, path, args.steps)
    print(f"MoE layer {args.layer} of tiny-moe (8 experts, top-2) after {args.train_steps} training steps; "
          f"{args.tokens} tokens per step; forward + backward, median of {args.steps}")
    print(f"{'ep':>3} {'routing':>9} {'ours ms':>8} {'plain ms':>9} {'ratio':>6} {'a2a MB ours':>11} "
          f"{'plain':>7} {'exp imb':>8} {'rank imb':>8} {'max|diff|':>9}")
    summary: dict[str, Any] = {"benchmark": "moe", "train_steps": args.train_steps, "tokens": args.tokens, "results": {}}
    for ep, rows in results.items():
        paired_slow = rows.pop("real_over_balanced_paired")
        for kind, r in rows.items():
            print(f"{ep:>3} {kind:>9} {1e3 * r['ours_s']:>8.2f} {1e3 * r['plain_s']:>9.2f} {r['ratio']:>6.3f} "
                  f"{r['ours_wire_bytes'] / 2**20:>11.3f} {r['plain_wire_bytes'] / 2**20:>7.3f} "
                  f"{r['expert_imbalance']:>8.3f} {r['rank_imbalance']:>8.3f} {r['max_abs_diff']:>9.2e}")
        print(f"    ep{ep}: real routing takes {paired_slow:.3f}x the balanced step (ours; median of per-step ratios)")
        summary["results"][f"ep{ep}"] = {**rows, "real_over_balanced": paired_slow}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
