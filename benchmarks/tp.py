"""Tensor parallelism tp=2 and tp=4 on gloo: hybridpar's layers vs PyTorch DTensor TP, side by side.

For each tp in --tps, ``tp`` gloo processes each hold two copies of the same Llama (same
weights, same AdamW, same batches): one parallelised by ``parallelize_llama``, one by
``torch.distributed.tensor.parallel.parallelize_module`` with ColwiseParallel / RowwiseParallel
/ SequenceParallel / PrepareModuleInput and ``loss_parallel`` (the torchtitan plan), with and
without sequence parallelism. Steps alternate between the two so noise hits both alike.

Reported per (tp, SP): median step time (forward, loss, backward, norm-gradient sync, AdamW) and
the ratio hybridpar / DTensor (target <= 1.0: our layers skip DTensor dispatch); tensor-parallel
bytes per rank per step (payload and ring wire bytes; ours from ``topo.comm.counter``, DTensor's
from its c10d functional collectives); activation bytes autograd saves per rank (forward + loss);
and the largest relative loss difference between the two.

    python benchmarks/tp.py [--steps 12] [--tps 2,4] [--section.key value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _spawn import run_ranks
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from hybridpar.config import load_config
from hybridpar.distributed.comm import wire_bytes
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.models.llama import Llama
from hybridpar.models.llama.parallelize import PLAN, parallelize_llama
from hybridpar.parallel.tensor import vocab_parallel_cross_entropy
from hybridpar.parallel.tensor_plan import reduce_replicated_grads
from hybridpar.training.optim import build_optimizer

DEFAULTS = ["--model.n_layers", "4", "--train.seq_len", "128", "--train.micro_batch", "4"]


class C10dCounter(TorchDispatchMode):
    """Counts DTensor's collectives (payload bytes, hybridpar's convention) as they dispatch,
    including those DTensor issues inside its own op dispatch (sharding redistributions)."""

    OPS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
           "reduce_scatter_tensor": "reduce_scatter"}

    def __init__(self, group_size: int) -> None:
        super().__init__()
        self.n = group_size
        self.totals: dict[str, list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        from torch.distributed.tensor import DTensor

        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower the op to collectives first (as CommDebugMode)
        name = func._overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name in self.OPS:
            op, t = self.OPS[name], args[0]
            nbytes = t.numel() * t.element_size()
            entry = self.totals.setdefault(op, [0, 0, 0])
            entry[0] += 1
            entry[1] += nbytes
            entry[2] += wire_bytes(op, nbytes, self.n)
        return func(*args, **(kwargs or {}))


def dtensor_plan(model: Llama, mesh: Any, sp: bool) -> Llama:
    """The torchtitan Llama plan; without SP the residual stream stays replicated."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    outer = Shard(1) if sp else Replicate()
    root: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=outer),
        "output": ColwiseParallel(input_layouts=outer, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        root["norm"] = SequenceParallel()
    parallelize_module(model, mesh, root)
    for block in model.layers:
        plan: dict[str, Any] = {
            # one entry per region, so q/k/v (and w1/w3) share one gather / gradient reduction
            "attention": PrepareModuleInput(input_layouts=(outer, None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=outer),
            "feed_forward": PrepareModuleInput(input_layouts=(outer,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=outer),
        }
        if sp:
            plan["attention_norm"] = plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, mesh, plan)
    return model


def saved_activation_bytes(model: nn.Module, fn: Callable[[], Tensor]) -> tuple[Tensor, int]:
    """``fn()`` and the bytes of the distinct storages autograd saved for backward (parameters
    excluded; DTensors counted by their local shard): this rank's activation memory."""
    def storages(t: Tensor) -> list[Any]:  # unwrap DTensor / async collective wrappers
        if is_traceable_wrapper_subclass(t):
            inner = (getattr(t, a) for a in t.__tensor_flatten__()[0])
            return [s for x in inner if isinstance(x, Tensor) for s in storages(x)]
        return [t.untyped_storage()]

    params = {s.data_ptr() for p in model.parameters() for s in storages(p)}
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        for s in storages(t):
            if s.data_ptr() not in params:
                seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def compare(topo: Any, cfg: Any, data: Tensor, sp: bool) -> dict[str, Any]:
    """Alternate steps of the two parallelisations of one model; times, losses, traffic, memory."""
    from torch.distributed.tensor.parallel import loss_parallel

    m, t, tp, steps = cfg.model, cfg.train, topo.tp, data.shape[0]
    ours = Llama(m)
    ours.init_weights(t.seed)
    parallelize_llama(ours, tp, sequence_parallel=sp)
    ref = Llama(m)
    ref.init_weights(t.seed)
    dtensor_plan(ref, topo.mesh["tp"], sp)
    opt_ours, opt_ref = build_optimizer(ours, t), build_optimizer(ref, t)
    norms = PLAN.replicated_params(ours)
    counter = C10dCounter(tp.size)
    times: dict[str, list[float]] = {"hybridpar": [], "dtensor": []}
    losses: dict[str, list[float]] = {"hybridpar": [], "dtensor": []}
    act: dict[str, int] = {}

    def ours_loss(x: Tensor, y: Tensor) -> Tensor:
        return vocab_parallel_cross_entropy(ours(x).float(), y, tp, m.vocab_size)

    def ref_loss(x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(ref(x).float().flatten(0, 1), y.flatten())

    for step in range(steps):
        x, y = data[step, :, :-1], data[step, :, 1:]
        dist.barrier()
        # step 0: activation memory; step 1: traffic; later steps: time (no hooks, no modes)
        if step == 1:
            topo.comm.counter.reset()
        t0 = time.perf_counter()
        if step == 0:
            loss, act["hybridpar"] = saved_activation_bytes(ours, lambda x=x, y=y: ours_loss(x, y))
        else:
            loss = ours_loss(x, y)
        loss.backward()
        if sp:
            reduce_replicated_grads(norms, tp)
        opt_ours.step()
        opt_ours.zero_grad()
        t1 = time.perf_counter()
        losses["hybridpar"].append(float(loss.detach()))
        if step == 1:
            ours_traffic = {k.split("/")[0]: [v["calls"], v["bytes"], v["wire_bytes"]]
                            for k, v in topo.comm.counter.snapshot().items()}
        dist.barrier()
        t2 = time.perf_counter()
        with loss_parallel(), counter if step == 1 else contextlib.nullcontext():
            if step == 0:
                loss, act["dtensor"] = saved_activation_bytes(ref, lambda x=x, y=y: ref_loss(x, y))
            else:
                loss = ref_loss(x, y)
            loss.backward()
            opt_ref.step()
            opt_ref.zero_grad()
        t3 = time.perf_counter()
        losses["dtensor"].append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
        if step >= 2:
            times["hybridpar"].append(t1 - t0)
            times["dtensor"].append(t3 - t2)
    return {"tp": tp.size, "sp": sp, "times": times, "losses": losses, "activation_bytes": act,
            "traffic_per_step": {"hybridpar": ours_traffic, "dtensor": counter.totals}}


def worker(rank: int, world: int, steps: int, overrides: list[str], out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_config(None, [*DEFAULTS, *overrides])
    m, t = cfg.model, cfg.train
    gen = torch.Generator().manual_seed(t.seed)
    data = torch.randint(0, m.vocab_size, (steps, t.micro_batch, t.seq_len + 1), generator=gen)
    with ParallelDims(tp=world).build("cpu") as topo:
        results = [compare(topo, cfg, data, sp) for sp in (False, True)]
    if rank == 0:
        out.put({"results": results, "params": m.num_params(),
                 "shape": f"{m.n_layers} layers, dim {m.dim}, batch {t.micro_batch}x{t.seq_len}"})
    dist.destroy_process_group()


def run_world(world: int, steps: int, overrides: list[str]) -> dict[str, Any]:
    (res,) = run_ranks(worker, world, steps, overrides)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--tps", default="2,4")
    args, overrides = ap.parse_known_args()
    rows, shape, params = [], "", 0
    for world in (int(v) for v in args.tps.split(",")):
        res = run_world(world, args.steps, overrides)
        rows += res["results"]
        shape, params = res["shape"], res["params"]
    print(f"tensor parallel on gloo, {params / 1e6:.2f}M params ({shape}); per rank, per step")
    head = (f"{'tp':>3} {'SP':>4} {'impl':<10}{'median ms':>10}{'ratio':>7}{'collectives':>12}"
            f"{'payload MB':>11}{'wire MB':>9}{'act MB':>8}")
    print(head)
    summary = []
    for r in rows:
        med = {k: statistics.median(v) for k, v in r["times"].items()}
        ratio = med["hybridpar"] / med["dtensor"]
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"]["hybridpar"], r["losses"]["dtensor"], strict=True))
        entry = {"tp": r["tp"], "sp": r["sp"], "ratio": round(ratio, 4), "max_rel_loss_diff": loss_diff}
        for impl in ("hybridpar", "dtensor"):
            tr = r["traffic_per_step"][impl]
            calls = sum(v[0] for v in tr.values())
            payload, wire = sum(v[1] for v in tr.values()), sum(v[2] for v in tr.values())
            act = r["activation_bytes"][impl]
            print(f"{r['tp']:>3} {'on' if r['sp'] else 'off':>4} {impl:<10}{1e3 * med[impl]:>10.1f}"
                  f"{ratio if impl == 'hybridpar' else 1.0:>7.3f}{calls:>12.0f}{payload / 2**20:>11.2f}"
                  f"{wire / 2**20:>9.2f}{act / 2**20:>8.2f}")
            entry[impl] = {"median_step_s": round(med[impl], 5), "collectives": calls,
                           "payload_bytes": int(payload), "wire_bytes": int(wire), "activation_bytes": act,
                           "by_op": {k: {"calls": v[0], "bytes": int(v[1])} for k, v in sorted(tr.items())}}
        summary.append(entry)
    worst = max(e["max_rel_loss_diff"] for e in summary)
    print(f"ratio = hybridpar / DTensor median step time (target <= 1.0); max relative loss difference {worst:.2e}")
    print(json.dumps({"benchmark": "tp", "target_ratio": 1.0, "results": summary}))


if __name__ == "__main__":
    main()
