"""Sampling text from a trained model (rank-local, no parallelism), and ``hybridpar generate``."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn


@torch.no_grad()
def sample(
    model: nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    max_seq_len: int,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[int]:
    """Autoregressive top-k sampling; returns prompt + new tokens (none for an empty prompt).
    Deterministic for a seed.

    ``forward`` maps tokens to full-vocabulary logits (default: ``model`` itself); a parallel
    model passes one that gathers vocab-sharded logits."""
    if not prompt:  # nothing to continue (e.g. train.sample_prompt = ""): no sample
        return []
    forward = forward or model
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tokens = list(prompt)
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        context = torch.tensor([tokens[-max_seq_len:]], dtype=torch.long, device=device)
        logits = forward(context)[0, -1].float().cpu()
        if temperature <= 0:
            nxt = int(torch.argmax(logits))
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        tokens.append(nxt)
    model.train(was_training)
    return tokens


def cmd_generate(argv: list[str]) -> int:
    """``hybridpar generate --checkpoint DIR --prompt TEXT [--tokens N] [--temperature T] ...``"""
    from hybridpar.models.registry import family_of
    from hybridpar.training.checkpoint import load_model_state, load_tokenizer_of

    ap = argparse.ArgumentParser(prog="hybridpar generate", description="Sample text from a checkpoint.")
    ap.add_argument("--checkpoint", required=True, help="a complete checkpoint directory (run_dir/checkpoints/step-N)")
    ap.add_argument("--prompt", default="", help="text to continue")
    ap.add_argument("--tokens", type=int, default=200, help="new tokens to sample")
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg, state = load_model_state(args.checkpoint)
    tokenizer = load_tokenizer_of(args.checkpoint)
    model = family_of(cfg.model).build(cfg.model)
    model.load_state_dict(state)
    prompt = tokenizer.encode(args.prompt or "\n")  # the model needs at least one token
    out = sample(model, prompt, args.tokens, cfg.model.max_seq_len, args.temperature, args.top_k, args.seed)
    print(tokenizer.decode(out))
    return 0
