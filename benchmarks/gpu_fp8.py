"""FP8 against bf16 on one GPU, hybridpar's ``fp8.recipe`` beside torchao's float8 training.

For each shape (``--shapes``: ``1b`` the Llama-3.2-1B shape, ``3b`` the Llama-3.2-3B shape; both
micro-batch 4 x 2048, global 8, bf16 autocast over fp32 master weights, compiled blocks) it times,
one model at a time, the median step after three warm-up (compiling) steps of:

* ``ours/none``, ``ours/tensorwise``, ``ours/rowwise``: hybridpar's ``Trainer.train_step`` with
  ``fp8.recipe`` = that recipe;
* ``torchao/none``, ``torchao/tensorwise``, ``torchao/rowwise``: the plain PyTorch loop of
  ``benchmarks/overhead.py`` (same model, AdamW, clipping; regional compile of each block),
  bf16, or with every block linear converted by torchao's ``convert_to_float8_training`` with that
  recipe (torchao's own module filter: the output head stays bf16, as ours does).

The table gives each step, each FP8 / bf16 ratio within its loop, ours against torchao at the
same recipe, the allocator's peak, and the planner's predicted step time and peak for ours
(``--gpu`` spec, default H200). With ``--loss-steps N`` (at the first shape) it also trains ours
with none / tensorwise / rowwise for N steps through the CLI, side by side on the GPU, and prints
the final losses (the FP8 loss is to stay within 1% of bf16's).

    python benchmarks/gpu_fp8.py [--device cuda|cpu] [--shapes 1b,3b] [--steps 20] [--loss-steps 200]

On CPU (``--device cpu --quick``) the same code runs at a tiny shape without compiling and
without torchao, so the script cannot rot; its ratios mean nothing there.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from overhead import PlainLoop

from hybridpar.config import Config, load_config
from hybridpar.distributed import device as devices
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.planner.front.fit import layout_and_workload
from hybridpar.planner.machine.hardware import Cluster, gpu_spec
from hybridpar.planner.memory.plan import plan_memory
from hybridpar.planner.price.cost import step_cost
from hybridpar.training.trainer import Trainer

COMMON = ["--model.max_seq_len", "2048", "--train.seq_len", "2048", "--train.global_batch", "8",
          "--train.micro_batch", "4", "--train.precision", "bf16", "--model.vocab_size", "128256",
          "--model.tie_embeddings", "true"]
SHAPES: dict[str, list[str]] = {
    "1b": ["--model.dim", "2048", "--model.n_layers", "16", "--model.n_heads", "32", "--model.n_kv_heads", "8",
           "--model.ffn_hidden", "8192", *COMMON],
    "3b": ["--model.dim", "3072", "--model.n_layers", "28", "--model.n_heads", "24", "--model.n_kv_heads", "8",
           "--model.ffn_hidden", "8192", *COMMON],
    "tiny": ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
             "--model.ffn_hidden", "128", "--model.max_seq_len", "64", "--train.seq_len", "64",
             "--train.global_batch", "4", "--train.micro_batch", "2"],
}
RECIPES = ("none", "tensorwise", "rowwise")


def planned(cfg: Config, gpu: str) -> dict[str, float]:
    """The planner's step time (s) and peak live bytes for ``cfg`` on one ``gpu``: what the
    measured step and ``max_memory_allocated`` are compared with."""
    layout, work = layout_and_workload(cfg)
    mem = plan_memory(cfg.model, layout, work)
    return {"step_s": step_cost(cfg.model, layout, work, Cluster.of(gpu_spec(gpu), 1, 1)).step_time_s,
            "peak_bytes": mem.total - mem.components["overhead"]}


def time_steps(step: Callable[[int], object], device: torch.device, steps: int) -> dict[str, float]:
    """Three warm-up steps (compiling), then the median of ``steps`` synchronized steps, and the
    allocator's peak over all of them."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for s in range(1, 4):
        step(s)
    devices.synchronize(device)
    warm = time.perf_counter() - start
    times = []
    for s in range(4, 4 + steps):
        start = time.perf_counter()
        step(s)
        devices.synchronize(device)
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "warmup_s": warm, "peak_bytes": devices.memory_bytes(device)}


def release(device: torch.device) -> None:
    """Free the last model's memory and compiled graphs before the next one is built (also
    ``benchmarks/gpu.py``'s, between its parts)."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def config(shape: str, recipe: str, device: torch.device, compiled: bool) -> Config:
    return load_config(None, [*SHAPES[shape], "--train.device", device.type, "--fp8.recipe", recipe,
                              "--train.compile", str(compiled).lower()])


def ours(shape: str, recipe: str, device: torch.device, steps: int, compiled: bool, gpu: str) -> dict[str, Any]:
    """hybridpar's step with ``fp8.recipe = recipe``, measured and as the planner predicts it."""
    cfg = config(shape, recipe, device, compiled)
    trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel).build(device.type), device)
    out = time_steps(trainer.train_step, device, steps)
    del trainer
    release(device)
    return {**out, "planned": planned(cfg, gpu)}


def torchao_loop(shape: str, recipe: str, device: torch.device, steps: int, compiled: bool) -> dict[str, Any]:
    """The plain loop, its block linears converted to torchao's float8 training (``recipe``)."""
    cfg = config(shape, "none", device, compiled)
    loop = PlainLoop(cfg, device)
    if recipe != "none":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(loop.model, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=lambda mod, fqn: fqn.startswith("layers."))
    if compiled:
        for block in loop.model.layers:
            block.forward = torch.compile(block.forward)
    out = time_steps(loop.step, device, steps)
    del loop
    release(device)
    return out


def torchao_available() -> str | None:
    """torchao's version, or None where it cannot be imported."""
    try:
        import torchao
        from torchao.float8 import convert_to_float8_training  # noqa: F401
    except Exception:  # any import failure (missing, or built for another torch) means: not run
        return None
    return str(getattr(torchao, "__version__", "?"))


def final_loss(shape: str, recipe: str, device: str, steps: int, root: Path) -> dict[str, Any]:
    """``hybridpar train`` at ``shape`` with ``fp8.recipe = recipe`` for ``steps`` steps: its last
    loss (its progress goes to ``<run_dir>.log`` and is echoed when the run ends)."""
    run = root / recipe
    args = [sys.executable, "-m", "hybridpar", "train", *SHAPES[shape], "--train.device", device,
            "--fp8.recipe", recipe, "--train.compile", str(device == "cuda").lower(), "--train.steps", str(steps),
            "--train.log_every", str(max(1, steps // 4)), "--train.eval_every", "0", "--train.sample_tokens", "0",
            "--train.global_batch", "4", "--train.run_dir", str(run)]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        return {"status": f"exit {done.returncode}: {(done.stdout + done.stderr)[-400:]}"}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    out = {"status": "ok", "loss": rows[-1]["loss"], "step": rows[-1]["step"], "step_time_s": rows[-1]["step_time_s"]}
    print(f"  loss run {recipe} done: {json.dumps(out)}", flush=True)
    return out


def losses(shape: str, device: str, steps: int) -> dict[str, Any]:
    """Every recipe's final loss, the three runs side by side; each FP8 loss relative to bf16's."""
    with tempfile.TemporaryDirectory(prefix="hybridpar-fp8-") as tmp, ThreadPoolExecutor(len(RECIPES)) as pool:
        runs = {r: pool.submit(final_loss, shape, r, device, steps, Path(tmp)) for r in RECIPES}
        out = {r: f.result() for r, f in runs.items()}
    base = out["none"].get("loss")
    for r in RECIPES[1:]:
        if base and out[r].get("loss") is not None:
            out[r]["vs_bf16"] = round(out[r]["loss"] / base - 1, 5)
    return out


LOOPS = tuple(f"{loop}/{r}" for loop in ("ours", "torchao") for r in RECIPES)


def measure_shape(shape: str, loops: list[str], device: torch.device, steps: int, compiled: bool, gpu: str
                  ) -> dict[str, Any]:
    """Each of ``loops`` (``ours/<recipe>``, ``torchao/<recipe>``) at one shape, then the ratios
    the targets are stated in: FP8 / bf16 within each loop, and ours / torchao per recipe."""
    res: dict[str, Any] = {}
    for name in loops:
        loop, recipe = name.split("/")
        res[name] = (ours(shape, recipe, device, steps, compiled, gpu) if loop == "ours"
                     else torchao_loop(shape, recipe, device, steps, compiled))
        # each loop as it ends: a run stopped at its time limit still says what it measured
        print(f"  {shape}: {name} done: {json.dumps(res[name])}", flush=True)
    ratio = {}
    for r in RECIPES:
        for loop in ("ours", "torchao"):
            if r != "none" and {f"{loop}/{r}", f"{loop}/none"} <= res.keys():
                ratio[f"{loop}/{r}"] = res[f"{loop}/{r}"]["step_s"] / res[f"{loop}/none"]["step_s"]
        if {f"ours/{r}", f"torchao/{r}"} <= res.keys():
            ratio[f"ours_vs_torchao/{r}"] = res[f"ours/{r}"]["step_s"] / res[f"torchao/{r}"]["step_s"]
    return {"runs": res, "ratio": {k: round(v, 4) for k, v in ratio.items()}}


def table(result: dict[str, Any]) -> str:
    lines = [f"device {result['device']} ({result['device_name']}), torch {result['torch']}, "
             f"torchao {result['torchao']}, compiled {result['compiled']}"]
    for shape, r in result["shapes"].items():
        lines.append(f"  {shape}: {'loop/recipe':<20}{'step ms':>9}{'planned':>9}{'err':>7}{'peak GiB':>10}"
                     f"{'planned':>9}{'err':>7}")
        for name, m in r["runs"].items():
            p = m.get("planned")
            row = f"  {shape}: {name:<20}{1e3 * m['step_s']:>9.1f}"
            if p:
                row += (f"{1e3 * p['step_s']:>9.1f}{100 * (p['step_s'] / m['step_s'] - 1):>6.1f}%"
                        f"{m['peak_bytes'] / 2**30:>10.2f}{p['peak_bytes'] / 2**30:>9.2f}"
                        f"{100 * (p['peak_bytes'] / m['peak_bytes'] - 1):>6.1f}%")
            else:
                row += f"{'':>16}{m['peak_bytes'] / 2**30:>10.2f}"
            lines.append(row)
        lines.append(f"  {shape}: ratios " + ", ".join(f"{k} {v:.3f}" for k, v in r["ratio"].items()))
    for recipe, r in result.get("losses", {}).items():
        lines.append(f"  loss after {result['loss_steps']} steps ({result['loss_shape']}) {recipe:<11} "
                     + (f"{r['loss']:.4f}" + (f" ({100 * r['vs_bf16']:+.2f}% of bf16)" if "vs_bf16" in r else "")
                        if r["status"] == "ok" else r["status"][:120]))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="the tiny shape, 2 timed steps (CPU check)")
    ap.add_argument("--shapes", default="1b,3b", help="comma-separated (1b, 3b); empty: none")
    ap.add_argument("--loops", default=",".join(LOOPS), help=f"comma-separated, of {', '.join(LOOPS)}")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per loop")
    ap.add_argument("--loss-steps", type=int, default=0, help="also train N steps per recipe through the CLI")
    ap.add_argument("--loss-shape", default="1b")
    ap.add_argument("--gpu", default="H200", help="the planner's GPU spec for the predictions")
    args = ap.parse_args()
    device = torch.device(args.device)
    shapes = ["tiny"] if args.quick and args.shapes else [s for s in args.shapes.split(",") if s]
    compiled = device.type == "cuda"
    ao = torchao_available() if device.type == "cuda" else None
    result: dict[str, Any] = {"benchmark": "gpu_fp8", "device": str(device), "device_name": devices.device_name(device),
                              "torch": torch.__version__, "torchao": ao, "compiled": compiled, "shapes": {}}
    loops = [n for n in args.loops.split(",") if n and (ao is not None or not n.startswith("torchao/"))]
    if args.loss_steps:  # first: the runs side by side, before anything is timed alone
        shape = "tiny" if args.quick else args.loss_shape
        result |= {"loss_shape": shape, "loss_steps": args.loss_steps,
                   "losses": losses(shape, args.device, args.loss_steps)}
        print(table(result), flush=True)
    for shape in shapes:
        result["shapes"][shape] = measure_shape(shape, loops, device, 2 if args.quick else args.steps, compiled,
                                                args.gpu)
        print(table(result), flush=True)
    print(table(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
