"""Sampling text from a trained model (rank-local, no parallelism)."""

from __future__ import annotations

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
) -> list[int]:
    """Autoregressive top-k sampling; returns prompt + new tokens. Deterministic for a seed."""
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tokens = list(prompt)
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        context = torch.tensor([tokens[-max_seq_len:]], dtype=torch.long, device=device)
        logits = model(context)[0, -1].float().cpu()
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
