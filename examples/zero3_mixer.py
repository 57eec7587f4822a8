"""Example 2: a small MLP-Mixer (not a transformer) trained with ZeRO-3 through
``hybridpar.initialize``, with gradient accumulation, clipping and a warm-up + cosine LR.

    torchrun --nproc-per-node 2 examples/zero3_mixer.py
    torchrun --nproc-per-node 4 examples/zero3_mixer.py --steps 10

Each Mixer block is one ZeRO-3 unit (``zero3_units="children"``: one unit per child module; the
blocks sit in a ``ModuleList``, so here the patterns ``blocks.*`` name them). Every rank also
trains the same model in one process with plain PyTorch and compares losses and weights; the
exit status is 1 on mismatch.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hybridpar

PATCHES, CHANNELS, HIDDEN, CLASSES, DEPTH, GLOBAL, ACCUM = 16, 24, 48, 5, 3, 16, 2
CFG = {"zero_stage": 3, "zero3_units": ["stem", "blocks.*", "head"], "lr": 3e-3, "weight_decay": 0.05,
       "grad_clip": 1.0, "gradient_accumulation_steps": ACCUM, "warmup_steps": 3, "decay_steps": 30,
       "min_lr": 3e-4}


class MixerBlock(nn.Module):
    """Token mixing (an MLP across patches) then channel mixing (an MLP across channels)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(CHANNELS), nn.LayerNorm(CHANNELS)
        # No bias on the token-mixing output: a per-patch constant across channels is removed by
        # every LayerNorm after it, so its true gradient is 0 and Adam would amplify rounding noise.
        self.tok = nn.Sequential(nn.Linear(PATCHES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, PATCHES, bias=False))
        self.chan = nn.Sequential(nn.Linear(CHANNELS, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, CHANNELS))

    def forward(self, x: Tensor) -> Tensor:  # [B, patches, channels]
        x = x + self.tok(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.chan(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, CHANNELS)  # 2x2 pixel patches -> channels
        self.blocks = nn.ModuleList(MixerBlock() for _ in range(DEPTH))
        self.head = nn.Sequential(nn.LayerNorm(CHANNELS), nn.Linear(CHANNELS, CLASSES))

    def forward(self, images: Tensor) -> Tensor:  # [B, 8, 8]
        b = images.shape[0]
        patches = images.reshape(b, 4, 2, 4, 2).permute(0, 1, 3, 2, 4).reshape(b, PATCHES, 4)
        x = self.stem(patches)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


def make_model() -> Mixer:
    torch.manual_seed(0)
    return Mixer()


def batch(step: int, micro: int) -> tuple[Tensor, Tensor]:
    """Synthetic 8x8 images whose class is the quadrant holding the bright blob (or none)."""
    gen = torch.Generator().manual_seed(1000 * step + micro)
    y = torch.randint(0, CLASSES, (GLOBAL,), generator=gen)
    x = torch.randn(GLOBAL, 8, 8, generator=gen) * 0.3
    for i, c in enumerate(y.tolist()):
        if c < 4:
            r, col = divmod(c, 2)
            x[i, 4 * r:4 * r + 4, 4 * col:4 * col + 4] += 1.0
    return x, y


def reference(steps: int) -> tuple[list[float], dict[str, Tensor]]:
    """Plain PyTorch in one process on the whole batch."""
    model, cfg = make_model(), hybridpar.EngineConfig.from_dict(CFG)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: cfg.lr_factor(i + 1))
    losses = []
    for step in range(steps):
        opt.zero_grad()
        for m in range(ACCUM):
            x, y = batch(step, m)
            loss = F.cross_entropy(model(x), y)
            (loss / ACCUM).backward()
            losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
    return losses, model.state_dict()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args(argv)
    topo = hybridpar.initialize_parallelism()  # dp = every process
    try:
        engine = hybridpar.initialize(make_model(), CFG, topo=topo)
        dp = topo.dp
        losses = []
        for step in range(args.steps):
            for m in range(ACCUM):
                x, y = batch(step, m)
                mine = slice(dp.rank * GLOBAL // dp.size, (dp.rank + 1) * GLOBAL // dp.size)
                loss = F.cross_entropy(engine(x[mine]), y[mine].to(topo.device))
                engine.backward(loss)
                engine.step()
                losses.append(float(topo.comm.all_reduce(loss.detach().clone(), dp)) / dp.size)
            if topo.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
                print(f"step {step:3d}  loss {losses[-1]:.4f}  lr {engine.lr:.2e}  "
                      f"grad norm {engine.last_grad_norm:.3f}", flush=True)
        state = engine.full_state_dict()  # ZeRO-3 shards gathered
        ref_losses, ref_state = reference(args.steps)
        ok = torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        ok = ok and state.keys() == ref_state.keys()
        ok = ok and all(torch.allclose(state[k], ref_state[k], rtol=1e-4, atol=1e-6) for k in ref_state)
        if not ok and topo.rank == 0:
            print("loss diff", (torch.tensor(losses) - torch.tensor(ref_losses)).abs().max().item(),
                  "keys equal", state.keys() == ref_state.keys(), sorted(set(state) ^ set(ref_state))[:5])
            for k in ref_state:
                if k in state and not torch.allclose(state[k], ref_state[k], rtol=1e-4, atol=1e-6):
                    print(k, (state[k] - ref_state[k]).abs().max().item())
        bad = topo.comm.all_reduce(torch.tensor([0.0 if ok else 1.0]), topo.world)
        if topo.rank == 0:
            verdict = "matches" if float(bad) == 0 else "DOES NOT match"
            print(f"ZeRO-3 on dp{dp.size}: final loss {losses[-1]:.4f} (single process {ref_losses[-1]:.4f}); "
                  f"{verdict} the single-process run")
        return 0 if float(bad) == 0 else 1
    finally:
        hybridpar.destroy_parallelism()


if __name__ == "__main__":
    sys.exit(main())
