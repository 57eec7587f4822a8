"""The seed's GPT-2 loop under real DeepSpeed and under hybridpar's DeepSpeed front door, side by side.

A small ``GPT2LMHeadModel`` from a config (2 layers, n_embd 64, vocab 256, head tied to the
embedding), the same ds_config for both (AdamW lr 1e-3, weight decay 0.1 on every parameter,
clipping 1.0, ``torch_adam``), a fixed batch stream (global batch 8 x 32 tokens, each dp rank its
rows), ZeRO stages 0-3 at dp 2 in fp32 and bf16, 20 steps. Prints the per-step losses of both, the
largest relative difference, and the step-time ratio (ours / DeepSpeed's: the median over
``--repeats`` launches of each side, alternating, of each launch's median step), a table for people and one JSON line.

DeepSpeed runs from its own virtual environment (``--ds-python``, default ``/work/dsvenv/bin/python``:
DeepSpeed must not go into the project's venv); ours runs with the same interpreter and
``PYTHONPATH=src``, so both use one torch. DeepSpeed on CPU: ``DS_ACCELERATOR=cpu``, gloo,
``OMP_NUM_THREADS=1``. Without DeepSpeed the script says so and runs only our side.

Bounds: fp32 1e-5 relative per step (the issue's target). bf16: DeepSpeed keeps the weights in
bf16 (fp32 masters in the optimizer) and runs the whole forward in bf16, while hybridpar keeps
fp32 weights and runs the forward under autocast (matmul operands and outputs in bf16; norms,
softmax and the loss in fp32), so the two forwards round at different places. The bound, first
order in the unit roundoff u = 2**-8 (bf16 keeps 8 significant bits, round to nearest):

1. Logits. Both start each step from the same fp32 weights (to the fp32 bound). On its way to
   the logits z the residual stream passes 2 * layers sublayers (attention, MLP) and the head,
   each a matmul whose operands and output are rounded to bf16 on one side or the other: a
   relative perturbation of at most u of the quantity rounded at each of these 2 * layers + 1
   places. The final LayerNorm removes the stream's scale and each sublayer's output is
   added to (not multiplied into) the stream, so to first order the perturbations add:
   ``|dz|_inf <= (2 * layers + 1) * u * |z|_inf`` (a well-conditioned network; its gain
   from a sublayer's input to the logits taken as <= 1 — the assumption the measurement checks).
2. Loss. Cross-entropy's gradient in the logits is ``softmax(z) - onehot``, whose L1 norm is at
   most 2, so ``|dL| <= 2 |dz|_inf`` per token and so for the mean over tokens.
3. Relative. ``|dL| / L <= 2 (2 * layers + 1) u |z|_inf / L``; for this model |z|_inf < L (an
   untrained LM near the uniform loss ln 256 = 5.5 with logits of order 1), so
   ``BF16_BOUND = 2 * (2 * layers + 1) * u`` (3.9e-2 at 2 layers).
4. Later steps. The gradients differ by the same relative order, and AdamW's update
   ``lr * m / (sqrt(v) + eps)`` is invariant to a common scale, so the weights drift by about
   ``lr * step * O(u)`` per element, a loss change far below step 1's term over 20 steps;
   except for elements whose gradient is at rounding level, where the update's sign can flip
   (at most ``2 * lr`` per step each). This part is not bounded a priori: the measured
   per-step maximum is reported next to the bound, and a run over it is printed as OVER.

Usage: ``python benchmarks/deepspeed_peer.py [--stages 0 1 2 3] [--precisions fp32 bf16] [--repeats 3]``
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STEPS, GLOBAL, SEQ, LAYERS = 20, 8, 32, 2
FP32_BOUND = 1e-5
BF16_BOUND = 2 * (2 * LAYERS + 1) * 2.0**-8


def ds_config(stage: int, precision: str, comm: str = "") -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_batch_size": GLOBAL, "gradient_accumulation_steps": 1,
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1, "torch_adam": True}},
                           "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if comm:  # both sides: DeepSpeed's own default for bf16 is bf16
        cfg["communication_data_type"] = comm
    return cfg


def _model() -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=LAYERS, n_embd=64, n_head=4, vocab_size=256, n_positions=SEQ, bos_token_id=0,
                        eos_token_id=0, tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _run_once(side: str, stage: int, precision: str, comm: str = "") -> tuple[list[float], list[float]]:
    """One fresh model and engine, 20 steps: (mean loss over dp per step, step seconds)."""
    import torch
    import torch.distributed as dist

    ds = __import__("deepspeed" if side == "deepspeed" else "hybridpar")
    model = _model()
    engine, _, _, _ = ds.initialize(model=model, model_parameters=model.parameters(), config=ds_config(stage, precision, comm))
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = GLOBAL // world
    losses, times = [], []
    for step in range(STEPS):
        ids = torch.randint(0, 256, (GLOBAL, SEQ), generator=torch.Generator().manual_seed(1000 + step))
        mine = ids[rank * rows:(rank + 1) * rows]
        start = time.perf_counter()
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    if hasattr(engine, "close"):
        engine.close()
    return losses, times


def worker(args: argparse.Namespace) -> None:
    """Inside torchrun: ``--repeats`` fresh runs; rank 0 writes the losses of the first and the
    median step time (steps 3 on) of each to ``--out``."""
    import torch.distributed as dist

    if args.worker == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    runs = [_run_once(args.worker, args.stage, args.precision, args.comm_dtype) for _ in range(args.repeats)]
    if dist.get_rank() == 0:
        part = Path(args.out + ".part")  # renamed whole: a process killed mid-write leaves no result
        part.write_text(json.dumps({"losses": runs[0][0], "step_s": [statistics.median(t[3:]) for _, t in runs]}))
        part.replace(args.out)
    dist.destroy_process_group()


def launch(python: str, side: str, stage: int, precision: str, repeats: int, comm: str = "") -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT / "src")}
        cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(29500 + stage),
               str(Path(__file__).resolve()), "--worker", side, "--stage", str(stage), "--precision", precision,
               "--repeats", str(repeats), "--out", str(out)] + (["--comm-dtype", comm] if comm else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if out.is_file():  # rank 0 writes it after every step ran: a crash at exit does not void the numbers
            if proc.returncode != 0:  # DeepSpeed 0.19.8 on CPU sometimes aborts at interpreter exit
                print(f"note: {side} stage {stage} {precision} exited {proc.returncode} after writing its "
                      "results (crash at shutdown: 'terminate called without an active exception'); kept")
            return json.loads(out.read_text())
        lines = (proc.stdout + proc.stderr).strip().splitlines() or ["no output"]
        errors = [line for line in lines if "Error:" in line and "ChildFailedError" not in line]
        why = errors[0] if errors else lines[-1]  # the worker's exception, not torchrun's summary
        raise RuntimeError(f"{side} stage {stage} {precision} failed: {why.strip()}\n" + "\n".join(lines[-40:]))


def has_deepspeed(python: str) -> str | None:
    """None when ``python`` imports deepspeed, else why not."""
    if not Path(python).exists():
        return f"{python} does not exist"
    probe = subprocess.run([python, "-c", "import deepspeed"], capture_output=True, text=True,
                           env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return None if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["import failed"])[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ds-python", default=os.environ.get("DS_PYTHON", "/work/dsvenv/bin/python"))
    p.add_argument("--worker", choices=["deepspeed", "hybridpar"])
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--out", default="")
    p.add_argument("--comm-dtype", default="", choices=["", "fp32", "bf16"],
                   help="communication_data_type on both sides (default: each side's own default)")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    missing = has_deepspeed(args.ds_python)
    python = args.ds_python if missing is None else sys.executable
    if missing is not None:
        print(f"DeepSpeed is not installed ({missing}): running only hybridpar's side. Install it in its own venv: "
              "python -m venv /work/dsvenv && DS_BUILD_OPS=0 /work/dsvenv/bin/pip install deepspeed transformers")
    rows = []
    for precision in args.precisions:
        for stage in args.stages:
            try:
                row = compare(python, stage, precision, args.repeats, with_deepspeed=missing is None,
                              comm=args.comm_dtype)
            except RuntimeError as e:  # one configuration failing does not hide the others' numbers
                row = {"stage": stage, "precision": precision, "error": str(e).splitlines()[0]}
                print(f"stage {stage} {precision}: failed: {e}")  # the launch's last lines: why
                rows.append(row)
                continue
            rows.append(row)
            _print_row(row)
    print(json.dumps({"benchmark": "deepspeed_peer", "deepspeed": missing is None, "steps": STEPS, "rows": rows}))


def compare(python: str, stage: int, precision: str, repeats: int, with_deepspeed: bool,
            comm: str = "") -> dict[str, Any]:
    """One configuration: ``repeats`` launches of each side, alternating (ours, DeepSpeed, ours,
    ...) so that a shared machine's changing load falls on both alike; losses of the first."""
    ours: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []
    for _ in range(repeats):
        ours.append(launch(python, "hybridpar", stage, precision, 1, comm))
        if with_deepspeed:
            theirs.append(launch(python, "deepspeed", stage, precision, 1, comm))
    row: dict[str, Any] = {"stage": stage, "precision": precision, "comm_dtype": comm or "default", "ours_losses": ours[0]["losses"],
                           "ours_step_s": statistics.median(r["step_s"][0] for r in ours),
                           "ours_step_s_runs": [r["step_s"][0] for r in ours]}
    if with_deepspeed:
        diffs = [abs(a - b) / abs(b) for a, b in zip(ours[0]["losses"], theirs[0]["losses"], strict=True)]
        bound = FP32_BOUND if precision == "fp32" else BF16_BOUND
        ds_step = statistics.median(r["step_s"][0] for r in theirs)
        row.update(ds_losses=theirs[0]["losses"], ds_step_s=ds_step, ds_step_s_runs=[r["step_s"][0] for r in theirs],
                   max_rel_diff=max(diffs), bound=bound,
                   within=max(diffs) <= bound, time_ratio=row["ours_step_s"] / ds_step)
    return row


def _print_row(row: dict[str, Any]) -> None:
    head = f"stage {row['stage']} {row['precision']}: ours {row['ours_step_s'] * 1e3:.1f} ms/step"
    if "ds_losses" not in row:
        print(head + f"; losses {[round(x, 5) for x in row['ours_losses']]}")
        return
    print(head + f", DeepSpeed {row['ds_step_s'] * 1e3:.1f} ms/step, ratio {row['time_ratio']:.2f}; max relative "
          f"loss difference {row['max_rel_diff']:.2e} (bound {row['bound']:.1e}, {'ok' if row['within'] else 'OVER'})")
    for i, (a, b) in enumerate(zip(row["ours_losses"], row["ds_losses"], strict=True)):
        print(f"    step {i + 1:2d}  ours {a:.7f}  deepspeed {b:.7f}")


if __name__ == "__main__":
    main()
