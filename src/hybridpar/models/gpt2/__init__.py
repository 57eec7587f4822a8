"""The GPT-2 family (``GPT2LMHeadModel``): learned positions, LayerNorm, GELU (tanh), biases
everywhere, a tied head and HF's fused Conv1D ``c_attn``.

Structurally unlike Llama, it is the whole folder: :mod:`.model` (the math), :mod:`.hf` (Hugging
Face names and config; ``c_attn`` split into q/k/v and Conv1D weights transposed),
:mod:`.parallelize` (the tensor-parallel plan; the learned positions under sequence
parallelism) and :mod:`.pipeline` (a pipeline stage's chunk). :data:`FAMILY` is what the rest of
hybridpar sees."""

from __future__ import annotations

from hybridpar.models.common import attention_modules, blocks, zero3_units
from hybridpar.models.family import Family
from hybridpar.models.gpt2.hf import GPT2HF, gpt2_config_from_hf, to_hf_config_dict
from hybridpar.models.gpt2.model import GPT2, Attention, Block, FeedForward, init_tensor
from hybridpar.models.gpt2.parallelize import PLAN, parallelize_gpt2
from hybridpar.models.gpt2.pipeline import GPT2Chunk

__all__ = ["FAMILY", "GPT2", "GPT2HF", "Attention", "Block", "FeedForward", "GPT2Chunk", "gpt2_config_from_hf",
           "init_tensor", "parallelize_gpt2", "to_hf_config_dict"]

FAMILY = Family(name="gpt2", build=GPT2, tp=PLAN, parallelize=parallelize_gpt2, attention_modules=attention_modules, blocks=blocks,
                zero3_units=zero3_units, make_chunk=GPT2Chunk, hf=GPT2HF())
