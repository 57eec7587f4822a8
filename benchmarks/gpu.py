"""One command for whoever has a GPU: smoke, overhead, MFU and a profile summary, one table.

In under 5 minutes on one H100 (``--device cuda``, the default) it runs:

1. **smoke**: a short ``hybridpar train --train.device cuda`` run of every single-process feature
   (bf16, fp16, MoE, document masks, recompute, ZeRO-1 optimizer offload, compile, async
   checkpoints with an exact resume, generate), each a separate CLI process whose exit status is
   checked (the resume's loss must equal the uninterrupted run's);
2. **overhead**: hybridpar's eager and compiled step against plain PyTorch at the 0.7B shape (dim
   1536, 24 layers, 12/4 heads, ffn 4096, vocab 32000, batch 8 x 2048, bf16), with the loops of
   ``benchmarks/overhead.py``;
3. **cli_mfu**: MFU logged by ``hybridpar train`` (compiled) at the Llama-3.2-1B shape (dim 2048, 16
   layers, 32/8 heads, ffn 8192, vocab 128256, tied; micro-batch 4 x 2048, global 8);
4. **profile**: torch.profiler over a few of hybridpar's steps: host syncs per step
   (``cudaStreamSynchronize`` + ``cudaDeviceSynchronize`` calls; device-to-host copies counted
   apart), the optimizer's share of the step, and kernel time against wall time.

It prints one table and one JSON line (``{"benchmark": "gpu", ...}``). Without a visible GPU it
says so and exits 2, unless ``--device cpu``: then everything that exists on CPU runs (compile is
left out: inductor's CPU build is minutes), and ``--quick`` shrinks every shape to a tiny model so
the whole script takes about a minute (``tests/test_gpu_benchmark.py`` runs it so it cannot rot).
On CPU the profile counts forced transfers as the aten ops that read a tensor's value on the
host (``aten::_local_scalar_dense``, ``aten::is_nonzero``) and kernel time as the ops' self time.

``--parts`` picks some of the four. FP8 against bf16 (ours and torchao's) is
``benchmarks/gpu_fp8.py``; multi-rank layouts with CUDA tensors on one GPU are
``benchmarks/gpu_multirank.py``; ``benchmarks/gpu_session.sh`` runs all three as one prepared
command on a lent GPU. Beside each measured step and peak the table prints the planner's prediction
for the same config on an H200 (``PLANNER_GPU``).

    python benchmarks/gpu.py [--device cuda|cpu] [--quick] [--steps N] [--parts smoke,overhead,cli_mfu,profile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from gpu_fp8 import planned, release
from overhead import build_loops, compare_loops, mfu_of
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from hybridpar.config import load_config
from hybridpar.distributed import device as devices
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.planner.front.fit import predict, predicted_peak, read_run
from hybridpar.planner.machine.hardware import gpu_spec
from hybridpar.training.trainer import Trainer

#: the planner's GPU for the predictions beside each measurement (``--gpu``)
PLANNER_GPU = "H200"

SHAPE_07B = ["--model.dim", "1536", "--model.n_layers", "24", "--model.n_heads", "12", "--model.n_kv_heads", "4",
             "--model.ffn_hidden", "4096", "--model.vocab_size", "32000", "--model.max_seq_len", "2048",
             "--train.seq_len", "2048", "--train.global_batch", "8", "--train.micro_batch", "8",
             "--train.precision", "bf16"]
SHAPE_1B = ["--model.dim", "2048", "--model.n_layers", "16", "--model.n_heads", "32", "--model.n_kv_heads", "8",
            "--model.ffn_hidden", "8192", "--model.vocab_size", "128256", "--model.tie_embeddings", "true",
            "--model.max_seq_len", "2048", "--train.seq_len", "2048", "--train.global_batch", "8",
            "--train.micro_batch", "4", "--train.precision", "bf16", "--train.compile", "true"]
SHAPE_TINY = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
              "--model.ffn_hidden", "128", "--model.max_seq_len", "64", "--train.seq_len", "64",
              "--train.global_batch", "4", "--train.micro_batch", "2"]
SMOKE_BASE = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
              "--model.ffn_hidden", "128", "--model.max_seq_len", "64", "--train.seq_len", "64",
              "--train.global_batch", "4", "--train.micro_batch", "2", "--train.steps", "2", "--train.log_every", "1",
              "--train.eval_every", "0", "--train.sample_tokens", "8", "--train.warmup_steps", "1"]
#: feature -> the overrides that turn it on (each a short training run through the CLI)
FEATURES: dict[str, list[str]] = {
    "bf16": ["--train.precision", "bf16"],
    "fp16": ["--train.precision", "fp16"],
    "moe": ["--model.family", "mixtral", "--model.n_experts", "4", "--model.moe_ffn_hidden", "64"],
    "document_mask": ["--train.document_mask", "true"],
    "recompute": ["--parallel.recompute", "full"],
    "zero1_offload": ["--parallel.zero_stage", "1", "--parallel.offload_optimizer", "true"],
    "compile": ["--train.compile", "true"],
}
CUDA_ONLY = {"compile"}  # inductor's CPU build takes minutes: not part of the CPU run


def hybridpar(args: list[str], timeout_s: float) -> tuple[int, str]:
    """Run ``hybridpar ARGS`` as its own process: (exit status, the tail of its output)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    if "--train.device" in args and args[args.index("--train.device") + 1] == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")  # CLI runs side by side: one core each, no oversubscription
    try:
        done = subprocess.run([sys.executable, "-m", "hybridpar", *args], capture_output=True, text=True,
                              timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout_s:.0f} s"
    return done.returncode, (done.stdout + done.stderr)[-600:]


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from a run's ``metrics.jsonl``."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def smoke_feature(name: str, flags: list[str], device: str, root: Path, timeout_s: float) -> dict[str, Any]:
    """One feature's short CLI training run: its status (``ok`` or the failure) and seconds."""
    start = time.perf_counter()
    rc, tail = hybridpar(["train", *SMOKE_BASE, "--train.device", device, "--train.run_dir", str(root / name),
                          *flags], timeout_s)
    return {"status": "ok" if rc == 0 else f"exit {rc}: {tail}", "seconds": round(time.perf_counter() - start, 1)}


def smoke_resume(device: str, root: Path, timeout_s: float) -> dict[str, dict[str, Any]]:
    """Async checkpoints with an exact resume (2 steps straight, checkpoints at 1 and 2; a second
    run resumed from the step-1 checkpoint must log the same step-2 loss), then ``hybridpar
    generate`` from the last checkpoint."""
    start = time.perf_counter()
    common = ["train", *SMOKE_BASE, "--train.device", device, "--async_checkpoint.enabled", "true",
              "--train.checkpoint_every", "1"]
    whole, part = root / "resume_whole", root / "resume_part"
    steps = [hybridpar([*common, "--train.run_dir", str(whole)], timeout_s)]
    ckpts = sorted((whole / "checkpoints").glob("step-*"))
    if steps[0][0] == 0 and ckpts:
        steps.append(hybridpar([*common, "--train.run_dir", str(part), "--resume", str(ckpts[0])], timeout_s))
    failed = [f"exit {rc}: {tail}" for rc, tail in steps if rc != 0]
    status = failed[0] if failed else "ok" if len(steps) == 2 else "no checkpoint written"
    if status == "ok" and losses(whole)[2] != losses(part)[2]:
        status = f"resumed loss {losses(part)[2]!r} != uninterrupted {losses(whole)[2]!r}"
    out = {"async_checkpoint_resume": {"status": status, "seconds": round(time.perf_counter() - start, 1)}}
    start = time.perf_counter()
    rc, tail = hybridpar(["generate", "--checkpoint", str(ckpts[-1] if ckpts else whole), "--tokens", "8",
                          "--prompt", "The "], timeout_s)
    out["generate"] = {"status": "ok" if rc == 0 else f"exit {rc}: {tail}",
                       "seconds": round(time.perf_counter() - start, 1)}
    return out


def smoke(device: str, jobs: int, timeout_s: float) -> dict[str, dict[str, Any]]:
    """Every single-process feature's smoke run on ``device``, ``jobs`` CLI processes at a time."""
    features = {k: v for k, v in FEATURES.items() if device == "cuda" or k not in CUDA_ONLY}
    with tempfile.TemporaryDirectory(prefix="hybridpar-gpu-") as tmp, ThreadPoolExecutor(jobs) as pool:
        root = Path(tmp)
        resume = pool.submit(smoke_resume, device, root, timeout_s)
        runs = {k: pool.submit(smoke_feature, k, v, device, root, timeout_s) for k, v in features.items()}
        results = {k: f.result() for k, f in runs.items()}
        results.update(resume.result())
    return results


def overhead(shape: list[str], device: torch.device, steps: int, rounds: int, compiled: bool) -> dict[str, Any]:
    """hybridpar's step against plain PyTorch (``benchmarks/overhead.py``'s loops), eager or
    compiled: median step times, ratios and MFU."""
    cfg = load_config(None, [*shape, "--train.device", device.type, "--train.compile", str(compiled).lower()])
    torch.manual_seed(cfg.train.seed)
    times, _ = compare_loops(build_loops(cfg, device, compiled), device, steps, rounds)
    med = {k: statistics.median(v) for k, v in times.items()}
    mfu, _ = mfu_of(cfg, device, med)
    plan = planned(cfg, PLANNER_GPU)
    out = {"median_step_ms": {k: round(1e3 * v, 2) for k, v in med.items()},
           "mfu": {k: round(v, 4) for k, v in mfu.items()}, "ratio": round(med["hybridpar"] / med["plain"], 4),
           "planned_step_ms": round(1e3 * plan["step_s"], 2),
           "planned_step_error": round(plan["step_s"] / med["hybridpar"] - 1, 4)}
    if compiled:
        out["ratio_vs_plain_compiled"] = round(med["hybridpar"] / med["plain_compiled"], 4)
    release(device)
    return out


def cli_mfu(shape: list[str], device: str, steps: int, timeout_s: float) -> dict[str, Any]:
    """The MFU ``hybridpar train`` itself logs at ``shape``: the last logged window's (the first
    steps, with compilation, are outside it)."""
    with tempfile.TemporaryDirectory(prefix="hybridpar-mfu-") as tmp:
        run = Path(tmp) / "run"
        rc, tail = hybridpar(["train", *shape, "--train.device", device, "--train.steps", str(steps),
                              "--train.log_every", str(max(1, steps // 2)), "--train.eval_every", "0",
                              "--train.sample_tokens", "8", "--train.run_dir", str(run)], timeout_s)
        if rc != 0:
            return {"status": f"exit {rc}: {tail}", "mfu": None}
        last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
        record = read_run(run)
        predicted_step, predicted_peak_bytes = predict(record, gpu_spec(PLANNER_GPU)), predicted_peak(record)
    step = last["step_time_s"]
    peak = max(record.peak_memory, default=0)
    return {"status": "ok", "mfu": last["mfu"], "step_time_s": round(step, 4),
            "tokens_per_s": round(last["tokens_per_s"], 1), "peak_bytes": peak,
            "planned_step_s": round(predicted_step, 4), "planned_step_error": round(predicted_step / step - 1, 4),
            "planned_peak_bytes": int(predicted_peak_bytes),
            "planned_peak_error": round(predicted_peak_bytes / peak - 1, 4) if peak else None}


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize")
HOST_READS = ("aten::_local_scalar_dense", "aten::is_nonzero")  # an op that reads a value on the host


def host_reads(events: list[Any]) -> int:
    """CPU: the ops that read a tensor's value on the host, except inside the optimizer's step:
    torch's CPU optimizers keep their per-parameter ``step`` counters in host tensors and read
    them there (``_fused_adamw_`` on CPU calls ``item``), which waits for nothing; on CUDA the
    fused optimizer keeps them on the device (``tests/test_host_syncs.py`` draws the same line)."""
    def in_optimizer(e: Any) -> bool:
        while e is not None:
            if e.name.startswith("Optimizer.step#"):
                return True
            e = e.cpu_parent
        return False
    return sum(1 for e in events if e.name in HOST_READS and not in_optimizer(e))


def profile_steps(shape: list[str], device: torch.device, steps: int) -> dict[str, Any]:
    """torch.profiler over ``steps`` of hybridpar's (compiled on CUDA) steps after a warm-up:
    syncs per step, the optimizer's share of the step and kernel time against wall time."""
    compiled = device.type == "cuda"
    cfg = load_config(None, [*shape, "--train.device", device.type, "--train.compile", str(compiled).lower()])
    step_fn = Trainer(cfg, ParallelDims.from_config(cfg.parallel).build(device.type), device).train_step
    for s in range(1, 2 if device.type == "cpu" else 4):  # warm-up (and compile)
        step_fn(s)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    devices.synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for s in range(10, 10 + steps):
            step_fn(s)
        devices.synchronize(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    count = {e.key: e.count for e in events}
    optimizer = [e for e in events if e.key.startswith("Optimizer.step#")]
    if device.type == "cuda":
        syncs = sum(count.get(k, 0) for k in SYNC_CALLS) - 1  # less the timing's own synchronize above
        dtoh = sum(e.count for e in events if "DtoH" in e.key or "Device -> Pageable" in e.key
                   or "Device -> Pinned" in e.key)
        # the kernels, memcpys and memsets themselves: a CPU op's self device time is its kernels
        # again (summing both counted every kernel twice: 195% of the wall in the first H200 run)
        kernel_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
        optimizer_us = max((e.device_time_total for e in optimizer), default=0.0)  # outermost: no nested twice
    else:  # CPU: what forces a value onto the host, and the ops' own time
        syncs = host_reads(prof.events())
        dtoh = 0
        kernel_us = sum(e.self_cpu_time_total for e in events if e.key.startswith("aten::"))
        optimizer_us = max((e.cpu_time_total for e in optimizer), default=0.0)
    return {"steps": steps, "wall_ms_per_step": round(1e3 * wall / steps, 2),
            "host_syncs_per_step": round(syncs / steps, 2), "dtoh_copies_per_step": round(dtoh / steps, 2),
            "optimizer_share": round(optimizer_us / 1e6 / wall, 4),
            "kernel_ms_per_step": round(kernel_us / 1e3 / steps, 2),
            "kernel_over_wall": round(kernel_us / 1e6 / wall, 4)}


def table(result: dict[str, Any]) -> str:
    """The human-readable table of one run's result."""
    lines = [f"device {result['device']} ({result['device_name']}), torch {result['torch']}"
             + (" [quick]" if result["quick"] else "")]
    for name, r in result.get("smoke", {}).items():
        lines.append(f"  smoke {name:<26}{r['status'][:70]:<72}{r['seconds']:>7.1f} s")
    for mode, r in result.get("overhead", {}).items():
        ms = ", ".join(f"{k} {v:.1f} ms ({100 * r['mfu'][k]:.1f}% MFU)" for k, v in r["median_step_ms"].items())
        extra = f", vs plain compiled {r['ratio_vs_plain_compiled']:.3f}" if "ratio_vs_plain_compiled" in r else ""
        lines.append(f"  overhead {mode:<9} ratio {r['ratio']:.3f}{extra}: {ms}; planner "
                     f"{r['planned_step_ms']:.1f} ms ({100 * r['planned_step_error']:+.1f}%)")
    if "cli_mfu" in result:
        lines.append(cli_line(result["cli_shape"], result["cli_mfu"]))
    if "profile" not in result:
        return "\n".join(lines)
    p = result["profile"]
    lines.append(f"  profile: {p['host_syncs_per_step']} host syncs/step, {p['dtoh_copies_per_step']} DtoH copies/step, "
                 f"optimizer {100 * p['optimizer_share']:.1f}% of the step, kernels {p['kernel_ms_per_step']} ms "
                 f"of {p['wall_ms_per_step']} ms wall ({100 * p['kernel_over_wall']:.1f}%)")
    return "\n".join(lines)


def cli_line(shape: str, c: dict[str, Any]) -> str:
    """The table's line of the CLI run: its MFU and the planner's step time and peak beside it."""
    mfu = "n/a" if c.get("mfu") is None else f"{100 * c['mfu']:.1f}%"
    line = f"  cli MFU ({shape}): {mfu}, status {c['status'][:70]}"
    if c["status"] == "ok":
        line += (f"; step {1e3 * c['step_time_s']:.1f} ms, planner {1e3 * c['planned_step_s']:.1f} ms "
                 f"({100 * c['planned_step_error']:+.1f}%); peak {c['peak_bytes'] / 2**30:.2f} GiB, planner "
                 f"{c['planned_peak_bytes'] / 2**30:.2f} GiB"
                 + (f" ({100 * c['planned_peak_error']:+.1f}%)" if c["planned_peak_error"] is not None else ""))
    return line


PARTS = ("smoke", "overhead", "cli_mfu", "profile")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--parts`` asked for on ``args.device`` at the full shapes, or the tiny ones with
    ``--quick``."""
    device = torch.device(args.device)
    big, cli_shape = (SHAPE_TINY, SHAPE_TINY) if args.quick else (SHAPE_07B, SHAPE_1B)
    steps, rounds = (2, 1) if args.quick else (args.steps, 2)
    result: dict[str, Any] = {"benchmark": "gpu", "device": str(device), "device_name": devices.device_name(device),
                              "torch": torch.__version__, "quick": args.quick,
                              "cli_shape": "tiny" if args.quick else "llama-3.2-1b"}
    parts = args.parts.split(",")
    if "smoke" in parts:
        result["smoke"] = smoke(args.device, args.jobs or (2 if device.type == "cpu" else 4), args.timeout)
    if "overhead" in parts:
        result["overhead"] = {"eager": overhead(big, device, steps, rounds, compiled=False)}
        if device.type == "cuda":
            result["overhead"]["compiled"] = overhead(big, device, steps, rounds, compiled=True)
    if "cli_mfu" in parts:
        result["cli_mfu"] = cli_mfu(cli_shape, args.device, 4 if args.quick else 20, args.timeout)
    if "profile" in parts:
        result["profile"] = profile_steps(big, device, 2 if args.quick else 3)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes everywhere (about a minute on CPU)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per loop per round (overhead)")
    ap.add_argument("--jobs", type=int, default=0, help="smoke runs at a time (default: 4 on CUDA, 2 on CPU)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per CLI run before it counts as failed")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    args = ap.parse_args()
    if args.device == "cuda" and devices.accelerator_count() == 0:
        print("benchmarks/gpu.py: no GPU is visible (torch.cuda.is_available() is False, torch "
              f"{torch.__version__}); nothing was measured. Run it on a machine with a CUDA GPU, or pass "
              "--device cpu [--quick] for the CPU run.", file=sys.stderr)
        return 2
    result = run(args)
    print(table(result))
    print(json.dumps(result))
    failed = [k for k, v in result.get("smoke", {}).items() if v["status"] != "ok"] + \
        ([] if result.get("cli_mfu", {"status": "ok"})["status"] == "ok" else ["cli_mfu"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
