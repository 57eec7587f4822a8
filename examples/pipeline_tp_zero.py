"""Example 1: a two-stage model written with the tensor-parallel layers, composed into a
``PipelineModule`` and trained with the ZeRO optimizer on dp x tp x pp processes.

    torchrun --nproc-per-node 8 examples/pipeline_tp_zero.py              # dp2 x tp2 x pp2
    torchrun --nproc-per-node 4 examples/pipeline_tp_zero.py --dp 1       # tp2 x pp2

Stage 0: vocab-parallel embedding + a Megatron MLP block (column -> GELU -> row);
stage 1: another MLP block + a column-parallel head whose vocab-sharded logits go straight into
the vocab-parallel cross-entropy (full logits are never formed). Every rank also trains the same
model in one process with plain PyTorch and checks losses and weights; exit status 1 on mismatch.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hybridpar
from hybridpar.distributed.mesh import Axis, ParallelDims

VOCAB, HID, FFN, SEQ, GLOBAL, M = 64, 32, 64, 8, 8, 4


def full_weights(seed: int) -> dict[str, Tensor]:
    """The whole model's initial weights, the same on every rank whatever the layout."""
    gen = torch.Generator().manual_seed(seed)
    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen) * 0.1
    return {"emb": rnd(VOCAB, HID), "up0": rnd(FFN, HID), "up0_b": rnd(FFN), "down0": rnd(HID, FFN),
            "up1": rnd(FFN, HID), "up1_b": rnd(FFN), "down1": rnd(HID, FFN), "head": rnd(VOCAB, HID)}


class MLPBlock(nn.Module):
    """``x + down(gelu(up(x)))`` with ``up`` split along its outputs and ``down`` along its inputs:
    one all-reduce forward and one backward per block under tensor parallelism."""

    def __init__(self, up: Tensor, up_b: Tensor, down: Tensor, axis: Axis) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HID)
        self.up = hybridpar.ColumnParallelLinear.from_full(up, axis, up_b)
        self.down = hybridpar.RowParallelLinear.from_full(down, axis)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Stage0(nn.Module):
    def __init__(self, w: dict[str, Tensor], axis: Axis) -> None:
        super().__init__()
        self.emb = hybridpar.VocabParallelEmbedding.from_full(w["emb"], axis)
        self.block = MLPBlock(w["up0"], w["up0_b"], w["down0"], axis)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.block(self.emb(tokens))


class Stage1(nn.Module):
    def __init__(self, w: dict[str, Tensor], axis: Axis) -> None:
        super().__init__()
        self.block = MLPBlock(w["up1"], w["up1_b"], w["down1"], axis)
        self.head = hybridpar.ColumnParallelLinear.from_full(w["head"], axis)  # vocab-sharded logits

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(x))


def batch(step: int) -> tuple[Tensor, Tensor]:
    """A learnable toy task: the next token is (token * 3 + 1) mod VOCAB."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=gen)
    return x, (x * 3 + 1) % VOCAB


def reference(steps: int, lr: float, clip: float) -> tuple[list[float], dict[str, Tensor]]:
    """The same model trained in one process with plain PyTorch."""
    with ParallelDims().build() as topo:  # tp = 1: the parallel layers are plain nn computations
        w = full_weights(0)
        model = nn.Sequential(Stage0(w, topo.tp), Stage1(w, topo.tp))
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        losses = []
        for step in range(steps):
            x, y = batch(step)
            opt.zero_grad()
            total = 0.0
            for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True):
                loss = F.cross_entropy(model(xm).flatten(0, 1), ym.flatten())
                (loss / M).backward()
                total += float(loss.detach()) / M
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            losses.append(total)
        named = {f"stages.{k}": v.detach().clone() for k, v in model.state_dict().items()}
        return losses, named


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb-h1"])
    ap.add_argument("--zero-stage", type=int, default=1)
    args = ap.parse_args(argv)
    lr, clip = 1e-2, 1.0
    topo = hybridpar.initialize_parallelism(args.dp, args.tp, args.pp)
    try:
        tp, dp = topo.tp, topo.dp
        w = full_weights(0)
        # Two stages on pp = 2 ranks (with pp = 1 both run on one rank as one stage).
        stages = [Stage0(w, tp), Stage1(w, tp)] if args.pp == 2 else [nn.Sequential(Stage0(w, tp), Stage1(w, tp))]
        mb = GLOBAL // M // dp.size

        def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
            return hybridpar.vocab_parallel_cross_entropy(logits, targets, tp, VOCAB)

        pipe = hybridpar.PipelineModule(stages=stages, topo=topo, num_microbatches=M, loss_fn=loss_fn,
                                        activation_shape=(mb, SEQ, HID), schedule=args.schedule)
        opt = hybridpar.ZeroOptimizer(list(pipe.named_parameters()), dp, stage=args.zero_stage, lr=lr)
        losses = []
        for step in range(args.steps):
            x, y = batch(step)
            mbs = [(xm.chunk(dp.size)[dp.rank], ym.chunk(dp.size)[dp.rank])
                   for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True)]
            loss = torch.tensor([pipe.train_step(mbs, opt, max_norm=clip)])
            losses.append(float(topo.comm.all_reduce(loss, dp)) / dp.size)
            if topo.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
                print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
        state = hybridpar.full_tensor_parallel_state_dict(pipe.state_dict(), hybridpar.tp_sharded_params(pipe), tp)
        ref_losses, ref_state = reference(args.steps, lr, clip)
        if args.pp == 1:
            state = {k.replace("stages.0.", "stages."): v for k, v in state.items()}
        ok = torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        ok = ok and all(torch.allclose(v, ref_state[k], rtol=1e-4, atol=1e-6) for k, v in state.items())
        bad = topo.comm.all_reduce(torch.tensor([0.0 if ok else 1.0]), topo.world)
        if topo.rank == 0:
            verdict = "matches" if float(bad) == 0 else "DOES NOT match"
            print(f"dp{dp.size} x tp{tp.size} x pp{topo.pp.size}: final loss {losses[-1]:.4f} "
                  f"(single process {ref_losses[-1]:.4f}); {verdict} the single-process run")
        return 0 if float(bad) == 0 else 1
    finally:
        hybridpar.destroy_parallelism()


if __name__ == "__main__":
    sys.exit(main())
