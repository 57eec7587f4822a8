"""Example 4: the DeepSpeed seed snippet, unchanged but for the import and a small GPT-2 from a
config instead of the hub download, on hybridpar's DeepSpeed front door.

    torchrun --nproc-per-node 2 examples/deepspeed_seed.py --stage 2 --precision fp16
    torchrun --nproc-per-node 2 examples/deepspeed_seed.py --stage 3 --precision bf16

(``STAGE`` / ``PRECISION`` in the environment work too.) The seed calls ``model_engine(batch)``
and backpropagates what comes back, so the model takes a batch and returns its loss (as it must
under DeepSpeed too). Every rank also runs the same loop in one process with plain PyTorch (the
whole global batch, ``torch.optim.AdamW``, autocast for bf16/fp16 as the front door's precision
is) and compares per-step losses: fp32 within 1e-5 relative (the same math, summed in another
order), bf16 / fp16 within ``2 (2 layers + 1) u`` (u = 2**-8 / 2**-11: one rounding per matmul
operand the dp split may round differently; benchmarks/deepspeed_peer.py derives it). fp16
skips steps whose loss-scaled gradients overflow, which plain PyTorch does not: there only
finite losses are required. Exit status 1 on mismatch.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hybridpar as deepspeed

GLOBAL, SEQ, LAYERS = 16, 32, 2
BOUNDS = {"fp32": 1e-5, "bf16": 2 * (2 * LAYERS + 1) * 2.0**-8, "fp16": 2 * (2 * LAYERS + 1) * 2.0**-11}


class SeedGPT2(GPT2LMHeadModel):
    """GPT-2 whose forward takes the seed's ``batch`` (token ids) and returns the LM loss."""

    def forward(self, batch: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(input_ids=batch, labels=batch).loss


def make_model() -> SeedGPT2:
    torch.manual_seed(0)
    return SeedGPT2(GPT2Config(n_layer=LAYERS, n_embd=64, n_head=4, vocab_size=256, n_positions=SEQ,
                               bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def global_batches(steps: int) -> list[torch.Tensor]:
    return [torch.randint(0, 256, (GLOBAL, SEQ), generator=torch.Generator().manual_seed(s)) for s in range(steps)]


def config(stage: int, precision: str) -> dict:
    """The seed's ds_config at ``stage`` with ``precision``'s block."""
    cfg = {"train_batch_size": GLOBAL, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def single_process(steps: int, precision: str) -> list[float]:
    """The same loop in one process, plain PyTorch, the whole global batch."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # DeepSpeed's AdamW decays every parameter
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    losses = []
    for batch in global_batches(steps):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = model(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, default=int(os.environ.get("STAGE", "2")))
    p.add_argument("--precision", choices=list(BOUNDS), default=os.environ.get("PRECISION", "fp32"))
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's call, kept

    # ---- the seed snippet ----
    model = make_model()
    config_params = config(args.stage, args.precision)
    model_engine, optimizer, _, _ = deepspeed.initialize(model=model, config_params=config_params)
    dp = model_engine.topo.dp
    rows = GLOBAL // dp.size
    train_dataloader = [b[dp.rank * rows:(dp.rank + 1) * rows] for b in global_batches(args.steps)]
    losses = []
    for batch in train_dataloader:
        loss = model_engine(batch)
        model_engine.backward(loss)
        model_engine.step()
        losses.append(float(model_engine.topo.comm.all_reduce(loss.detach().float().clone(), dp, op="avg")))
    # ---- end of the seed ----
    return report(losses, args, model_engine)


def report(losses: list[float], args: argparse.Namespace, engine: Any) -> int:
    """Compare with the single-process loop; print on rank 0; 0 when within the bound."""
    rank, skipped = engine.topo.rank, engine.skipped_steps
    engine.close()
    ok = all(math.isfinite(x) for x in losses)
    bound = BOUNDS[args.precision]
    worst = 0.0
    if args.precision != "fp16" or skipped == 0:
        ref = single_process(args.steps, args.precision)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True))
        ok = ok and worst <= bound
    if rank == 0:
        print(f"ZeRO-{args.stage} {args.precision}: losses {[round(x, 5) for x in losses]}, {skipped} skipped "
              f"steps; largest relative difference from the single-process run {worst:.2e} (bound {bound:.1e})")
        print("matches the single-process run" if ok else "MISMATCH with the single-process run")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
