"""The Llama family: :mod:`.model` (the math), :mod:`.hf` (Hugging Face names and config),
:mod:`.parallelize` (the tensor-parallel plan and the modules other parallelisms use) and
:mod:`.pipeline` (a pipeline stage's chunk). :data:`FAMILY` is what the rest of hybridpar sees."""

from __future__ import annotations

from hybridpar.models.family import Family
from hybridpar.models.llama.hf import LlamaHF
from hybridpar.models.llama.model import (
    Attention,
    Block,
    Documents,
    FeedForward,
    Llama,
    RMSNorm,
    apply_rope,
    init_tensor,
    precompute_rope,
    rotate_half,
    segment_positions,
)
from hybridpar.models.llama.parallelize import (
    PLAN,
    attention_modules,
    blocks,
    parallelize_llama,
    parallelize_moe,
    zero3_units,
)
from hybridpar.models.llama.pipeline import LlamaChunk

__all__ = ["FAMILY", "Attention", "Block", "Documents", "FeedForward", "Llama", "LlamaChunk", "RMSNorm",
           "apply_rope", "init_tensor", "parallelize_llama", "precompute_rope", "rotate_half",
           "segment_positions"]


def llama_family(name: str, hf: LlamaHF) -> Family:
    """A family with Llama's math and plan and ``hf``'s Hugging Face mapping (the Llama-like
    families Qwen2, Qwen3 and Mistral differ from Llama only there and in their config features)."""
    return Family(name=name, build=Llama, tp=PLAN, parallelize=parallelize_llama, attention_modules=attention_modules, blocks=blocks,
                  zero3_units=zero3_units, make_chunk=LlamaChunk, hf=hf, parallelize_moe=parallelize_moe)


FAMILY = llama_family("llama", LlamaHF())
