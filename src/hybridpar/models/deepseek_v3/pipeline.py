"""DeepSeek-V3's pipeline chunk: Llama's, with the multi-token prediction modules on the last
stage beside the shared head (DeepSeek-V3's own placement). They embed the tokens ahead, so the
last stage holds a mirror of the embedding, the tied-embedding mechanism of
:mod:`hybridpar.parallel.pipeline.stages` (``tied``: its gradient is summed with the first
stage's after every backward), and reads the micro-batch's input ids (``reads_tokens``: the
runner passes them)."""

from __future__ import annotations

from torch import Tensor, nn

from hybridpar.models.common import Documents, project
from hybridpar.models.deepseek_v3.mtp import attach_mtp_loss
from hybridpar.models.llama.pipeline import LlamaChunk
from hybridpar.parallel.pipeline.partition import ChunkSpec

__all__ = ["DeepseekV3Chunk"]


class DeepseekV3Chunk(LlamaChunk):
    """:class:`~hybridpar.models.llama.LlamaChunk` of a
    :class:`~hybridpar.models.deepseek_v3.DeepseekV3`; the last chunk also holds ``mtp`` (the
    model's modules, under their names) and adds their loss to the head's backward."""

    def __init__(self, model: nn.Module, spec: ChunkSpec) -> None:
        super().__init__(model, spec)
        self.cfg, self.moe_aux, self.mtp_tp = model.cfg, model.moe_aux, model.mtp_tp
        self.mtp = model.mtp if spec.head else nn.ModuleList()
        self.head_in = model.head_in
        self.reads_tokens = bool(spec.head and len(self.mtp))

    @staticmethod
    def embedding_at_head(model: nn.Module) -> bool:
        return model.output is None or len(model.mtp) > 0

    def finish(self, x: Tensor, tokens: Tensor | None, cos: Tensor, sin: Tensor,
               docs: Documents | None = None) -> Tensor:
        """The model's ``finish`` on the last layer's ``x``: the final norm, the multi-token
        prediction loss attached in training, the head."""
        h = attach_mtp_loss(self, self.norm(x), tokens, cos, sin, docs)
        return project(self.head_in(h), self.output, self.tok_embeddings)
