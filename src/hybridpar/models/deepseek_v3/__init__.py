"""The DeepSeek-V3 family (``DeepseekV3ForCausalLM``; Kimi K2 has its architecture):
:mod:`.model` (multi-head latent attention, group-limited sigmoid routing, multi-token
prediction), :mod:`.hf` (Hugging Face names and config, the MTP modules where DeepSeek's release
stores them), :mod:`.parallelize` (the tensor-parallel plan for MLA and the MTP modules),
:mod:`.pipeline` (Llama's chunk, with the MTP modules on the last stage) and :mod:`.mtp` (the
MTP loss under tp, cp and pp). Context parallelism, expert parallelism and ZeRO use Llama's
conventions (the MTP modules' attention among the modules cp replaces)."""

from __future__ import annotations

from hybridpar.models.deepseek_v3.hf import DeepseekV3HF
from hybridpar.models.deepseek_v3.model import (
           MTP,
           DeepseekV3,
           MLABlock,
           MLAttention,
           softmax_mscale,
)
from hybridpar.models.deepseek_v3.parallelize import (
           PLAN,
           attention_modules,
           parallelize_deepseek_v3,
)
from hybridpar.models.deepseek_v3.pipeline import DeepseekV3Chunk
from hybridpar.models.family import Family
from hybridpar.models.llama.parallelize import (
           blocks,
           parallelize_moe,
           zero3_units,
)

__all__ = ["FAMILY", "MTP", "DeepseekV3", "DeepseekV3Chunk", "DeepseekV3HF", "MLABlock", "MLAttention", "parallelize_deepseek_v3",
           "softmax_mscale"]

FAMILY = Family(name="deepseek_v3", build=DeepseekV3, tp=PLAN, parallelize=parallelize_deepseek_v3,
                attention_modules=attention_modules, blocks=blocks, zero3_units=zero3_units, make_chunk=DeepseekV3Chunk,
                hf=DeepseekV3HF(), parallelize_moe=parallelize_moe)
