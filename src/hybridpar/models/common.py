"""Pieces several families share: RoPE tables (Llama-like families; :mod:`.rope`), the metadata of packed
documents (every family: ``train.document_mask``), and the decoder naming conventions the
parallelisms rely on (which modules are attention, blocks, ZeRO-3 units)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hybridpar.config import ModelConfig
from hybridpar.distributed.mesh import Axis
from hybridpar.models.rope import precompute_rope
from hybridpar.parallel.loss import HeadInput, head_is_chunked, project_head
from hybridpar.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    pad_dim,
    padded_size,
)
from hybridpar.parallel.tensor_plan import enter_tp_region
from hybridpar.rules import tp_split_error

__all__ = ["DecoderChunk", "Documents", "column_parallel", "apply_rope", "attention_modules", "blocks", "check_tp_shape", "init_tensor", "name_seed", "precompute_rope",
           "rotate_half", "segment_positions", "zero3_units"]


# ----------------------------------------------------------------------------- RoPE


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim (the HF convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, heads, T, head_dim]`` by the angles in ``cos``/``sin [T, head_dim]``.

    Done in fp32 and cast back, so bf16 runs do not lose precision in the rotation.
    """
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


# ----------------------------------------------------------------------------- documents


@dataclass(frozen=True)
class Documents:
    """Packed documents of a batch (``train.document_mask``): tokens attend only within their
    own document (block-causal) and RoPE positions restart at each document start.

    ``segments [B, T]`` (int64): a document label per token, equal labels = same document; labels
    must be consistent over a whole sequence (context parallelism compares the labels of
    different ranks' tokens). ``positions [B, T]`` (int64): each token's position within its
    document, the RoPE position. Both hold this rank's tokens in the order of ``tokens``.
    """

    segments: Tensor
    positions: Tensor

    @classmethod
    def from_segments(cls, segments: Tensor) -> Documents:
        """From per-token document labels ``[B, T]`` of whole (unsharded) sequences."""
        return cls(segments, segment_positions(segments))

    def index_select(self, dim: int, index: Tensor) -> Documents:
        """The tokens at ``index`` along ``dim`` (e.g. a context-parallel shard)."""
        return Documents(self.segments.index_select(dim, index), self.positions.index_select(dim, index))

    def to(self, device: torch.device | str) -> Documents:
        return Documents(self.segments.to(device), self.positions.to(device))

    def rope(self, head_dim: int, theta: float, scaling: ModelConfig | None = None) -> tuple[Tensor, Tensor]:
        """``(cos, sin)`` ``[B, 1, T, head_dim]`` for the document-relative positions; ``scaling``:
        the model config whose ``rope_*`` fields scale the frequencies (None: unscaled)."""
        b, t = self.positions.shape
        cos, sin = precompute_rope(head_dim, self.positions.reshape(-1), theta, scaling)
        return cos.view(b, 1, t, head_dim), sin.view(b, 1, t, head_dim)

    def mask(self) -> Tensor:
        """Bool ``[B, 1, T, T]`` (True = visible): causal within the same document, for tokens in
        sequence order (no context-parallel sharding)."""
        t = self.segments.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=self.segments.device).tril_()
        return (causal & (self.segments[:, :, None] == self.segments[:, None, :])).unsqueeze(1)


def segment_positions(segments: Tensor) -> Tensor:
    """Position of each token within its run of equal labels along the last dim: ``[0, 0, 1, 1,
    1]`` -> ``[0, 1, 0, 1, 2]`` (a sequence's first token starts a run)."""
    t = segments.shape[-1]
    idx = torch.arange(t, device=segments.device).expand_as(segments)
    start = torch.ones_like(segments, dtype=torch.bool)
    start[..., 1:] = segments[..., 1:] != segments[..., :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=-1).values
    return idx - first


# ----------------------------------------------------------------------------- decoder conventions
# Every family names its parts alike (``tok_embeddings``, ``layers[i].attention``, ``norm``,
# ``output`` or None when tied), so what the parallelisms need of a model is stated once here.


def name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed from (seed, parameter name): sha256, not ``hash()`` (salted per
    process), so a parameter's initial value depends on nothing but its name and the seed."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_tensor(name: str, shape: Sequence[int], seed: int, cfg: ModelConfig) -> Tensor:
    """The full fp32 CPU initial value of parameter ``name`` (our naming), a pure function.

    GPT-2's scheme, which the Llama-like families use too: norm weights ones, biases zeros,
    every other weight normal(0, 0.02), the residual output projections (``wo``, ``w2``) with
    std ``0.02 / sqrt(2 * n_layers)`` so the residual stream's variance does not grow with
    depth. Each parameter has its own generator, so the values never depend on creation order,
    layer count or layout (any sharded layout builds the full tensor and keeps its slice).
    """
    shape = tuple(int(s) for s in shape)
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    std = 0.02
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "experts.w2", "shared_experts.w2.weight")):
        std /= math.sqrt(2 * cfg.n_layers)
    gen = torch.Generator(device="cpu").manual_seed(name_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules (context parallelism and selective recompute replace their core)."""
    return [block.attention for block in model.layers]


def blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (full recompute reruns each)."""
    return list(model.layers)


def zero3_units(model: nn.Module) -> list[nn.Module]:
    """ZeRO-3 units: the token embedding (unless the head reuses its weight, which then stays in
    the root with the head and the final norm) and every block."""
    units: list[nn.Module] = []
    if getattr(model, "output", None) is not None:
        units.append(model.tok_embeddings)
    units.extend(model.layers)
    return units


def check_tp_shape(cfg: ModelConfig, tp: int) -> None:
    """Raise ``ValueError`` (one line, numbers and fix) if ``cfg`` cannot be split ``tp`` ways:
    the ``tp-*`` rules of :mod:`hybridpar.rules`, the same ones ``validate`` applies."""
    message = tp_split_error(cfg, tp)
    if message is not None:
        raise ValueError(message)


class DecoderChunk(nn.Module):
    """A pipeline stage's part of a decoder that follows the naming conventions above: the token
    embedding (first chunk, and the last one when the head reuses it), a contiguous run of
    ``layers``, and ``norm`` + head (last chunk), all shared with the model (same parameters,
    same names). A family's chunk adds its forward (and what else its first chunk embeds).

    The chunk protocol of :mod:`hybridpar.parallel.pipeline.stages`: ``spec``, ``tied``,
    :meth:`embedding_weight`, and ``sequence_shards`` / ``positions``, which the engine sets."""

    def __init__(self, model: nn.Module, spec: Any) -> None:
        super().__init__()
        self.spec = spec
        self.tied = self.embedding_at_head(model)
        self.tok_embeddings = model.tok_embeddings if spec.embedding or (spec.head and self.tied) else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in spec.layers})
        self.norm = model.norm if spec.head else None
        self.output = model.output if spec.head else None
        # Hidden states arriving from the previous stage are split along the sequence in this
        # many parts (tensor parallelism with sequence parallelism).
        self.sequence_shards = 1
        # Original token positions of this rank's tokens when they are not 0..T-1 (context
        # parallelism's zigzag shards); None means arange.
        self.positions: Tensor | None = None

    @staticmethod
    def embedding_at_head(model: nn.Module) -> bool:
        """Whether the last chunk uses the token embedding too (a tied head; a family whose head
        embeds more, such as DeepSeek-V3's multi-token prediction, says so): the last stage
        then holds a mirror of it (``tied``)."""
        return model.output is None

    def embedding_weight(self) -> Tensor:
        """The (tied) embedding weight this chunk uses, read now (ZeRO-3 swaps parameters)."""
        return self.tok_embeddings.weight

    def head(self, x: Tensor) -> Tensor:
        """Logits of the last chunk: the final norm, then the head (or the tied embedding)."""
        return project(self.norm(x), self.output, self.tok_embeddings)

    def finish(self, x: Tensor, tokens: Tensor | None, cos: Tensor, sin: Tensor,
               docs: Documents | None = None) -> Tensor:
        """The last chunk's output of the last layer's ``x`` (:meth:`head`; a family with extra
        heads on the final norm's output, as the model's ``finish``, adds them here)."""
        return self.head(x)


def project(h: Tensor, output: nn.Module | None, tok_embeddings: nn.Module) -> Tensor | HeadInput:
    """The head on the final norm's output ``h``: the tied embedding's weight or the untied
    ``output`` layer. Inside :func:`~hybridpar.parallel.loss.chunked_head` the chunked loss's
    :class:`~hybridpar.parallel.loss.HeadInput` instead of the logits (the loss projects)."""
    if output is None:
        return project_head(h, tok_embeddings.weight)
    if output.bias is None and head_is_chunked(h):
        return project_head(h, output.weight)
    return output(h)


def column_parallel(layer: nn.Linear, axis: Axis, sequence_parallel: bool) -> nn.Module:
    """``layer`` as this rank's :class:`~hybridpar.parallel.tensor.ColumnParallelLinear` shard
    (bias split with its rows), taking its input already inside the tp region."""
    bias = None if layer.bias is None else layer.bias.detach()
    return ColumnParallelLinear.from_full(layer.weight.detach(), axis, bias=bias, sync_input=False,
                                          sequence_parallel=sequence_parallel)


# What Megatron's attention split shards (``TensorPlan.shard_dims``): q, k, v (and their biases)
# by rows (whole heads per rank), the output projection by columns.
ATTENTION_SHARDS = {
    "attention.wq.weight": 0, "attention.wk.weight": 0, "attention.wv.weight": 0,
    "attention.wq.bias": 0, "attention.wk.bias": 0, "attention.wv.bias": 0,
    "attention.wo.weight": 1,
}


def row_parallel(layer: nn.Linear, axis: Axis, sequence_parallel: bool) -> nn.Module:
    """``layer`` as this rank's :class:`~hybridpar.parallel.tensor.RowParallelLinear` shard
    (all-reduce, or reduce-scatter under SP; a bias replicated and added once after the sum)."""
    bias = None if layer.bias is None else layer.bias.detach()
    return RowParallelLinear.from_full(layer.weight.detach(), axis, bias=bias, sequence_parallel=sequence_parallel)


def split_attention(attn: nn.Module, axis: Axis, sequence_parallel: bool) -> None:
    """Megatron's attention split, in place: ``wq``/``wk``/``wv`` by columns (whole heads per
    rank), ``wo`` by rows. The caller divides its head counts."""
    sp = sequence_parallel
    attn.wq, attn.wk, attn.wv = (column_parallel(attn.wq, axis, sp), column_parallel(attn.wk, axis, sp),
                                 column_parallel(attn.wv, axis, sp))
    attn.wo = row_parallel(attn.wo, axis, sp)


def split_ends(model: nn.Module, axis: Axis, sequence_parallel: bool, head_in: nn.Module | None = None) -> None:
    """The decoder's ends under tp, in place: ``tok_embeddings`` by vocabulary (padded to a
    multiple of tp), the final ``norm``'s output (or ``head_in``'s: the module the head's input
    passes, where the norm's output has other readers outside the region) entering the tp
    region, and an untied ``output`` by columns over the padded vocabulary (a tied head uses the
    embedding's shard)."""
    sp = sequence_parallel
    model.tok_embeddings = VocabParallelEmbedding.from_full(model.tok_embeddings.weight.detach(),
                                                            axis, sequence_parallel=sp)
    enter_tp_region(model.norm if head_in is None else head_in, axis, sp)
    if model.output is not None:
        full = pad_dim(model.output.weight.detach(), 0, padded_size(model.cfg.vocab_size, axis.size))
        model.output = ColumnParallelLinear.from_full(full, axis, sync_input=False, sequence_parallel=sp)


def tensor_parallel(model: nn.Module, axis: Axis, sequence_parallel: bool,
                    split_block: Callable[[nn.Module, Axis, bool], None]) -> None:
    """Turn the full (initialised) ``model`` into this rank's tensor-parallel shard, in place:
    every block's attention (:func:`split_attention`), then the rest of the block by the family's
    ``split_block(block, axis, sequence_parallel)``, then the ends (:func:`split_ends`). Every rank
    of ``axis`` must pass the same weights; at tp=1 the model is left unchanged. Raises
    ``ValueError`` for shapes tp cannot split (:func:`check_tp_shape`). Build the optimizer
    afterwards (parameters are replaced)."""
    if axis.size == 1:
        return
    check_tp_shape(model.cfg, axis.size)
    for block in model.layers:
        split_attention(block.attention, axis, sequence_parallel)
        split_block(block, axis, sequence_parallel)
    split_ends(model, axis, sequence_parallel)
