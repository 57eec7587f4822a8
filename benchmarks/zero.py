"""ZeRO at dp=4 on gloo, side by side with PyTorch: hybridpar ZeRO-3 vs FSDP2 (``fully_shard``),
hybridpar ZeRO-0 vs ``DistributedDataParallel``.

Every process holds all four systems (same Llama weights, AdamW, micro-batches, clipping) and
rotates through them step by step, so noise hits them alike. Reported per system and rank 0:

* peak live bytes: what the system keeps between steps plus the highest transient during one
  step. Both come from glibc's malloc counters (``mallinfo2``: in-use heap + mmap bytes), which
  see every CPU tensor allocation, including FSDP2's storage resizes; the transient is sampled
  after every aten op (a dispatch mode) in a separate, untimed step;
* payload and ring-model wire bytes of the gradient / parameter collectives per step (ours from
  the comm counter; FSDP2 by wrapping ``dist.all_gather_single`` / ``reduce_scatter_single``;
  DDP through a counting comm hook), next to the formula;
* median step time and the ratio ours / PyTorch (targets: memory <= FSDP2, time <= 1.10).

``zero3`` prefetches the next unit's gather (overlap); ``zero3-np`` does not. FSDP2 on CPU
prefetches in backward only (its forward prefetch is opt-in). Where ZeRO-3's peak came from
(a per-aten-op malloc sampler like this script's, recording the units' states at the peak): it sits in the first
layer's backward of the last micro-batch, where the prefetched unit's gather buffer, every
earlier unit's reduce-scatter staging buffer (kept until the end of backward) and the unit's own
staging buffer, filled while its full parameters were still gathered, stacked on the activations
and the accumulated gradients: 1.07-1.08x FSDP2. Now a unit reduce-scatters after its
parameters are freed, one reduction is in flight at a time (waited before the next unit's
backward), and the backward prefetch starts once half of the unit's gradients are in (after
the peak): 0.95-0.99x with prefetch over four runs here (malloc counts include gloo's own
threads' buffers, so FSDP2's peak alone varies by about 3% run to run).

Both ZeRO-3 and FSDP2 reshard every unit after forward, the root included
(``reshard_after_forward=True``), so both move 2 all-gathers per micro-batch + 1 reduce-scatter.

    python benchmarks/zero.py [--steps 12] [--world 4] [--section.key value ...]

``--offload`` compares ZeRO-3 with offloaded optimizer state in host memory (``offload-cpu``)
and in memory-mapped files (``offload-disk``, ZeRO-Infinity), each also with the parameter
shards offloaded (``-params``): median step time, the ratio to ``offload-cpu``, and the bytes
each keeps after a step: optimizer state and parameter shards, and how much of them is resident
(in host memory; for files the kernel's count of their pages in memory, ``mincore``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _spawn import run_ranks
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from hybridpar.config import load_config
from hybridpar.distributed.comm import wire_bytes
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.models.llama import Llama
from hybridpar.models.llama.parallelize import zero3_units as llama_units
from hybridpar.parallel.zero import ZeroOptimizer, decay_groups, shard_model

DEFAULTS = ["--model.dim", "128", "--model.n_layers", "4", "--model.n_heads", "8", "--model.n_kv_heads", "4",
            "--model.ffn_hidden", "384", "--model.vocab_size", "256", "--train.seq_len", "64",
            "--train.global_batch", "16", "--train.micro_batch", "2"]


class _MallInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _malloc_reader() -> Callable[[], int]:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo
    except (OSError, AttributeError):
        return lambda: 0

    def used() -> int:
        m = libc.mallinfo2()
        return m.uordblks + m.hblkhd
    return used


malloc_used = _malloc_reader()


class PeakSampler(TorchDispatchMode):
    """Highest malloc in-use bytes seen after any aten op inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = malloc_used()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, malloc_used())
        return out


class Counted:
    """Payload / wire bytes of the collectives one PyTorch system issues."""

    def __init__(self, world: int) -> None:
        self.world, self.active = world, False
        self.bytes = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        self.wire = dict.fromkeys(self.bytes, 0)

    def add(self, op: str, nbytes: int) -> None:
        if self.active:
            self.bytes[op] += nbytes
            self.wire[op] += wire_bytes(op, nbytes, self.world)


def patch_fsdp_collectives(counter: Counted) -> None:
    """Count FSDP2's flat collectives (hybridpar's comm bound its own references at import)."""
    ag, rs = dist.all_gather_single, dist.reduce_scatter_single

    def all_gather_single(output, input, *a, **k):  # noqa: A002, ANN001
        counter.add("all_gather", input.numel() * input.element_size())
        return ag(output, input, *a, **k)

    def reduce_scatter_single(output, input, *a, **k):  # noqa: A002, ANN001
        counter.add("reduce_scatter", input.numel() * input.element_size())
        return rs(output, input, *a, **k)
    dist.all_gather_single, dist.reduce_scatter_single = all_gather_single, reduce_scatter_single


def ddp_hook(counter: Counted):
    # no annotations: DDP checks them against dist.GradBucket, and this module's are strings
    def hook(_state, bucket):  # noqa: ANN001, ANN202
        buf = bucket.buffer()
        counter.add("all_reduce", buf.numel() * buf.element_size())
        buf.div_(dist.get_world_size())
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])
    return hook


def torch_adamw(model: torch.nn.Module, cfg) -> torch.optim.AdamW:
    t = cfg.train
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)


def build(name: str, cfg, topo, counted: dict[str, Counted]) -> Callable[[list], float]:
    """One system; returns ``step(batches) -> mean local loss``."""
    t = cfg.train
    model = Llama(cfg.model)
    model.init_weights(t.seed)
    bucket = int(cfg.parallel.bucket_mb * 2**20)
    if name.startswith(("zero", "offload")):
        stage = 0 if name == "zero0" else 3
        sharded = shard_model(model, topo.dp, llama_units(model), prefetch=name == "zero3") if stage == 3 else None
        offload = {}  # offload-cpu, offload-disk, offload-cpu-params, offload-disk-params: ZeRO-3 + offload
        if name.startswith("offload"):
            offload = dict(offload=True, offload_to=name.split("-")[1], offload_params=name.endswith("params"))
        opt = ZeroOptimizer(decay_groups(model, t.weight_decay), topo.dp, stage=stage, bucket_bytes=bucket,
                            sharded=sharded, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **offload)
        no_sync, finish = opt.no_sync, opt.finish_grads

        def clip() -> None:
            opt.clip(opt.grad_norm_sq().sqrt(), t.grad_clip)
    elif name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        mesh = topo.mesh["dp"]
        for unit in llama_units(model):
            fully_shard(unit, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
        opt = torch_adamw(model, cfg)

        @contextlib.contextmanager
        def no_sync():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        def finish() -> None:
            pass

        def clip() -> None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
    else:
        ddp = DistributedDataParallel(model, bucket_cap_mb=cfg.parallel.bucket_mb)
        ddp.register_comm_hook(None, ddp_hook(counted["ddp"]))
        opt, no_sync = torch_adamw(model, cfg), ddp.no_sync
        model = ddp

        def finish() -> None:
            pass

        def clip() -> None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)

    def step(batches: list) -> float:
        opt.zero_grad()
        losses = []
        for i, (x, y) in enumerate(batches):
            with no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                (loss / len(batches)).backward()
            losses.append(loss.detach())
        finish()
        clip()
        opt.step()
        return float(torch.stack(losses).mean())
    step.optimizer = opt  # type: ignore[attr-defined]
    return step


OFFLOAD = ["offload-cpu", "offload-disk", "offload-cpu-params", "offload-disk-params"]


def offload_worker(rank: int, world: int, steps: int, overrides: list[str], out: Any) -> None:
    """``--offload``: ZeRO-3 with the optimizer state (and the parameter shards) in host memory
    or in files, stepped in turn; after each step, what each keeps where (its own count of its
    tensors, and the kernel's count of file pages in memory)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_config(None, [*DEFAULTS, "--parallel.dp", str(world), *overrides])
    t = cfg.train
    share = t.global_batch // world
    gen = torch.Generator().manual_seed(t.seed)
    with ParallelDims(dp=world).build("cpu") as topo:
        systems = {n: build(n, cfg, topo, {}) for n in OFFLOAD}
        times: dict[str, list[float]] = {n: [] for n in OFFLOAD}
        losses: dict[str, list[float]] = {n: [] for n in OFFLOAD}
        memory: dict[str, dict[str, int]] = {}
        for step in range(steps + 1):  # step 0 warms up
            tokens = torch.randint(0, cfg.model.vocab_size, (t.global_batch, t.seq_len + 1), generator=gen)
            mine = tokens[rank * share:(rank + 1) * share]
            data = [(mine[i:i + t.micro_batch, :-1], mine[i:i + t.micro_batch, 1:]) for i in range(0, share, t.micro_batch)]
            for name in OFFLOAD[step % len(OFFLOAD):] + OFFLOAD[:step % len(OFFLOAD)]:
                dist.barrier()
                t0 = time.perf_counter()
                losses[name].append(systems[name](data))
                if step:
                    times[name].append(time.perf_counter() - t0)
                memory[name] = systems[name].optimizer.memory_bytes()  # type: ignore[attr-defined]
    if rank == 0:
        out.put({"times": times, "losses": losses, "memory": memory, "params": cfg.model.num_params()})
    dist.destroy_process_group()


def offload_main(args: argparse.Namespace, overrides: list[str]) -> None:
    (res,) = run_ranks(offload_worker, args.world, args.steps, overrides)
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    print(f"dp={args.world} gloo, ZeRO-3, {res['params'] / 1e6:.2f}M params; bytes of rank 0 after a step")
    print(f"{'system':<20}{'median ms':>10}{'optim state MB':>16}{'resident MB':>13}{'param shards MB':>17}"
          f"{'resident MB':>13}")
    resident = {}
    for k, m in res["memory"].items():
        disk = k.startswith("offload-disk")
        resident[k] = {"optim": m.get("optim_resident", m["optim_offloaded"]),
                       "params": m["params_resident"] if k.endswith("disk-params") else m["params"]}
        print(f"{k:<20}{1e3 * med[k]:>10.1f}{m['optim_offloaded'] / 1e6:>16.3f}{resident[k]['optim'] / 1e6:>13.3f}"
              f"{m['params'] / 1e6:>17.3f}{resident[k]['params'] / 1e6:>13.3f}" + ("  (files)" if disk else ""))
    same = all(res["losses"][k] == res["losses"]["offload-cpu"] for k in OFFLOAD)
    summary = {"benchmark": "zero-offload", "world": args.world, "params": res["params"],
               "median_step_s": {k: round(v, 5) for k, v in med.items()},
               "time_ratio": {f"{k}/offload-cpu": round(med[k] / med["offload-cpu"], 4) for k in OFFLOAD},
               "optim_state_bytes": {k: m["optim_offloaded"] for k, m in res["memory"].items()},
               "resident_bytes": resident, "losses_identical": same}
    print("time / offload-cpu: " + ", ".join(f"{k} {v:.3f}" for k, v in summary["time_ratio"].items())
          + f"; losses identical across all four: {same}")
    print(json.dumps(summary))


def worker(rank: int, world: int, steps: int, overrides: list[str], out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_config(None, [*DEFAULTS, "--parallel.dp", str(world), *overrides])
    t = cfg.train
    names = ["zero3", "zero3-np", "fsdp2", "zero0", "ddp"]
    counted = {n: Counted(world) for n in ("fsdp2", "ddp")}
    patch_fsdp_collectives(counted["fsdp2"])
    share = t.global_batch // world
    gen = torch.Generator().manual_seed(t.seed)

    def batches() -> list:
        tokens = torch.randint(0, cfg.model.vocab_size, (t.global_batch, t.seq_len + 1), generator=gen)
        mine = tokens[rank * share:(rank + 1) * share]
        return [(mine[i:i + t.micro_batch, :-1], mine[i:i + t.micro_batch, 1:]) for i in range(0, share, t.micro_batch)]

    with ParallelDims(dp=world).build("cpu") as topo:
        systems, resident, peak, traffic, losses = {}, {}, {}, {}, {n: [] for n in names}
        times: dict[str, list[float]] = {n: [] for n in names}
        first = batches()
        for name in names:  # pay every one-time cost (gloo buffers, lazy inits) before measuring
            build(name, cfg, topo, counted)(first)
        for name in names:  # build, warm up, then one measured step per system
            gc.collect()
            base = malloc_used()
            systems[name] = build(name, cfg, topo, counted)
            losses[name].append(systems[name](first))
            gc.collect()
            start = malloc_used()
            resident[name] = start - base
            topo.comm.counter.reset()
            if name in counted:
                counted[name].active = True
            with PeakSampler() as sampler:
                systems[name](first)
            peak[name] = resident[name] + max(0, sampler.peak - start)
            c = topo.comm.counter
            if name in counted:
                counted[name].active = False
                traffic[name] = {"bytes": sum(counted[name].bytes.values()), "wire": sum(counted[name].wire.values())}
            else:
                ops = ("all_reduce",) if name == "zero0" else ("all_gather", "reduce_scatter")
                traffic[name] = {"bytes": sum(c.bytes(op, "dp") for op in ops),
                                 "wire": sum(c.wire_bytes(op, "dp") for op in ops)}
        for step in range(steps):
            data = batches()
            order = names[step % len(names):] + names[:step % len(names)]
            for name in order:
                dist.barrier()
                t0 = time.perf_counter()
                losses[name].append(systems[name](data))
                times[name].append(time.perf_counter() - t0)
    if rank == 0:
        out.put({"times": times, "losses": losses, "resident": resident, "peak": peak, "traffic": traffic,
                 "params": cfg.model.num_params(), "micro": t.global_batch // (world * t.micro_batch),
                 "shape": f"dim {cfg.model.dim} x {cfg.model.n_layers} layers, vocab {cfg.model.vocab_size}",
                 "batch": f"{t.global_batch}x{t.seq_len}"})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--offload", action="store_true",
                    help="ZeRO-3 offload to host memory vs to disk (and parameter offload): step time and resident bytes")
    args, overrides = ap.parse_known_args()
    if args.offload:
        offload_main(args, overrides)
        return
    (res,) = run_ranks(worker, args.world, args.steps, overrides)
    n, P, M = args.world, res["params"], res["micro"]
    ar = wire_bytes("all_reduce", 4 * P, n)
    zero3 = (2 * M + 1) * ar // 2
    formula = {"zero3": zero3, "zero3-np": zero3, "fsdp2": zero3, "zero0": ar, "ddp": ar}
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    print(f"dp={n} gloo, {P / 1e6:.2f}M params ({res['shape']}), batch {res['batch']}, {M} micro-batches/rank")
    print(f"{'system':<8}{'median ms':>11}{'resident MB':>13}{'peak MB':>10}{'payload MB':>12}{'wire MB':>10}{'formula MB':>12}")
    for k in res["times"]:
        tr = res["traffic"][k]
        print(f"{k:<8}{1e3 * med[k]:>11.1f}{res['resident'][k] / 1e6:>13.2f}{res['peak'][k] / 1e6:>10.2f}"
              f"{tr['bytes'] / 1e6:>12.3f}{tr['wire'] / 1e6:>10.3f}{formula[k] / 1e6:>12.3f}")
    pairs = (("zero3", "fsdp2"), ("zero3-np", "fsdp2"), ("zero0", "ddp"))
    loss_diff = {f"{a}/{b}": max(abs(x - y) / abs(y) for x, y in zip(res["losses"][a], res["losses"][b], strict=True))
                 for a, b in pairs}
    summary = {
        "benchmark": "zero", "world": n, "params": P, "micro_batches": M,
        "time_ratio": {f"{a}/{b}": round(med[a] / med[b], 4) for a, b in pairs},
        "peak_ratio": {f"{a}/{b}": round(res["peak"][a] / res["peak"][b], 4) for a, b in pairs},
        "peak_bytes": res["peak"], "resident_bytes": res["resident"],
        "wire_bytes": {k: v["wire"] for k, v in res["traffic"].items()}, "formula_wire_bytes": formula,
        "traffic_equals_formula": all(res["traffic"][k]["wire"] == formula[k] for k in formula),
        "max_rel_loss_diff": loss_diff, "median_step_s": {k: round(v, 5) for k, v in med.items()},
        "targets": {"time_ratio": 1.10, "peak_ratio": 1.0},
    }
    for a, b in pairs:
        print(f"{a:>8} / {b:<5}: time {summary['time_ratio'][f'{a}/{b}']:.3f} (target <= 1.10), peak "
              f"{summary['peak_ratio'][f'{a}/{b}']:.3f} (target <= 1), max loss diff {loss_diff[f'{a}/{b}']:.1e}")
    print(f"traffic equals the formula for every system: {summary['traffic_equals_formula']} "
          "(zero3-np: ZeRO-3 without prefetch, which is what FSDP2 does on CPU, having no streams)")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
