"""RoPE tables of the Llama-like families, with the frequency scalings transformers implements
for them (``rope_type``: ``default``, ``linear``, ``dynamic``, ``yarn``, ``llama3``).

The math follows ``transformers.modeling_rope_utils`` so Hugging Face checkpoints (Llama 3.1/3.2,
long-context Qwen) give the same logits. Positions are always explicit, so context parallelism's
zigzag shards and packed documents' restarting positions get the same table entries as the
whole sequence would.

``dynamic`` (NTK-aware) is the one scaling that depends on the input: transformers recomputes
its frequencies from the longest position of the call when it exceeds
``max_position_embeddings`` (= ``model.max_seq_len``). Here each call does the same from its
own positions, with no state kept between calls (transformers keeps the grown table until a
call is shorter than the original length, so only a call after a longer one can differ).
Training never reaches that: ``train.seq_len <= model.max_seq_len`` is a rule, so for every
trainable length (and under every layout) ``dynamic`` is the unscaled table, as in transformers.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hybridpar.config import ModelConfig

__all__ = ["ROPE_TYPES", "check_rope_type", "cos_sin_scale", "inv_freq", "precompute_rope"]

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def check_rope_type(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` (whose ``rope_*`` fields describe the scaling); ValueError naming an unknown type."""
    if cfg.rope_type not in ROPE_TYPES:
        raise ValueError(f"model.rope_type = {cfg.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    return cfg


def _original_len(s: ModelConfig) -> int:
    return s.rope_original_max_len or s.max_seq_len


def cos_sin_scale(s: ModelConfig | None) -> float:
    """The factor on cos and sin: yarn's attention temperature (1 for the other types)."""
    if s is None or s.rope_type != "yarn":
        return 1.0
    if s.rope_attention_factor:
        return s.rope_attention_factor
    return 1.0 if s.rope_factor <= 1 else 0.1 * math.log(s.rope_factor) + 1.0


def _even_dims(head_dim: int, device: torch.device) -> Tensor:
    """``0, 2, 4, ...`` (fp32, exact) made on ``device``: a table made on the host and moved
    would be a pageable host-to-device copy, which waits for the GPU, in every forward (the H200
    profile of 2026-11-28 counted it as the step's host sync)."""
    return torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)


def _base_inv_freq(head_dim: int, theta: float, device: torch.device) -> Tensor:
    return 1.0 / (theta ** (_even_dims(head_dim, device) / head_dim))


def _llama3(base: Tensor, s: ModelConfig) -> Tensor:
    old, low, high, factor = _original_len(s), s.rope_low_freq_factor, s.rope_high_freq_factor, s.rope_factor
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > low_wavelen, base / factor, base)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(head_dim: int, theta: float, s: ModelConfig, device: torch.device) -> Tensor:
    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(_original_len(s) / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.rope_beta_fast), correction_dim(s.rope_beta_slow)
    if s.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    # subtraction, division and clamp are correctly rounded everywhere: the same ramp on any device
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (_even_dims(head_dim, device) / head_dim)
    extrapolation = 1 - ramp
    return (1.0 / (s.rope_factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def inv_freq(head_dim: int, theta: float, scaling: ModelConfig | None = None, seq_len: int = 0,
             device: torch.device | str = "cpu") -> Tensor:
    """The ``head_dim / 2`` inverse frequencies (fp32) of the scaling ``scaling``'s ``rope_*``
    fields describe (None: unscaled); ``seq_len``: the call's longest position + 1, which only
    ``dynamic`` reads."""
    s, device = scaling, torch.device(device)
    kind = "default" if s is None else s.rope_type
    if kind == "yarn":
        return _yarn(head_dim, theta, s, device)
    if kind == "dynamic" and seq_len > s.max_seq_len:
        f = s.rope_factor
        theta = theta * ((f * seq_len / s.max_seq_len) - (f - 1)) ** (head_dim / (head_dim - 2))
    base = _base_inv_freq(head_dim, theta, device)
    if kind == "linear":
        return base / s.rope_factor
    if kind == "llama3":
        return _llama3(base, s)
    return base


def precompute_rope(head_dim: int, positions: Tensor, theta: float,
                    scaling: ModelConfig | None = None) -> tuple[Tensor, Tensor]:
    """``(cos, sin)``, each fp32 ``[len(positions), head_dim]``, for the given token positions.

    Positions are explicit (not ``arange``) so context parallelism can feed each rank its own,
    non-contiguous chunk of the sequence. Frequencies are duplicated across the two halves of
    the head, matching :func:`~hybridpar.models.common.rotate_half`.
    """
    dynamic = scaling is not None and scaling.rope_type == "dynamic" and positions.numel()
    seq_len = int(positions.max()) + 1 if dynamic else 0
    freq = inv_freq(head_dim, theta, scaling, seq_len, positions.device)
    freqs = positions.float()[:, None] * freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = cos_sin_scale(scaling)
    return emb.cos() * scale, emb.sin() * scale
