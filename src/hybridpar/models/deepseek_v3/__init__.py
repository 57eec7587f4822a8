"""The DeepSeek-V3 family (``DeepseekV3ForCausalLM``; Kimi K2 has its architecture):
:mod:`.model` (multi-head latent attention, group-limited sigmoid routing, multi-token
prediction), :mod:`.hf` (Hugging Face names and config, the MTP modules where DeepSeek's release
stores them) and :mod:`.parallelize` (the tensor-parallel plan for MLA). Pipeline chunks,
context parallelism, expert parallelism and ZeRO use Llama's conventions unchanged."""

from __future__ import annotations

from hybridpar.models.deepseek_v3.hf import DeepseekV3HF
from hybridpar.models.deepseek_v3.model import (
           MTP,
           DeepseekV3,
           MLABlock,
           MLAttention,
           softmax_mscale,
)
from hybridpar.models.deepseek_v3.parallelize import PLAN, parallelize_deepseek_v3
from hybridpar.models.family import Family
from hybridpar.models.llama import LlamaChunk
from hybridpar.models.llama.parallelize import (
           attention_modules,
           blocks,
           parallelize_moe,
           zero3_units,
)

__all__ = ["FAMILY", "MTP", "DeepseekV3", "DeepseekV3HF", "MLABlock", "MLAttention", "parallelize_deepseek_v3",
           "softmax_mscale"]

FAMILY = Family(name="deepseek_v3", build=DeepseekV3, tp=PLAN, parallelize=parallelize_deepseek_v3,
                attention_modules=attention_modules, blocks=blocks, zero3_units=zero3_units, make_chunk=LlamaChunk,
                hf=DeepseekV3HF(), parallelize_moe=parallelize_moe)
