"""Per-rank device memory of a layout, by component, for the worst pipeline stage.

Model states come from the exact parameter shapes each rank holds (the same tensor-parallel
split, vocabulary padding and pipeline partition the runtime uses), so for layouts the runtime
runs they equal its live tensor bytes. Bytes per parameter (P = parameters on the rank, N = dp):

* fp32 parameters (fp32 runs, and this runtime's autocast): 4 param + 4 grad + 8 Adam (m, v);
* half parameters (Megatron-LM / DeepSpeed mixed precision): 2 + 2 + 12 (fp32 master, m, v).

ZeRO (Rajbhandari et al. 2020): stage 1 shards the optimizer state over dp, stage 2 also the
gradients, stage 3 also the parameters; each parameter is split along dim 0 into ``ceil(rows/N)``
row blocks (:mod:`hybridpar.parallel.shard`), so the worst rank holds the rounded-up block.
Offload moves the optimizer state to host memory (reported as ``cpu_gib``).

Activations per layer and micro-batch follow Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", Table 2): GPT blocks store ``sbh(34 + 5as/h)``
bytes; with tensor parallelism ``sbh(10 + 24/t + 5as/(ht))``; plus sequence parallelism
``sbh(34/t + 5as/(ht))``; selective recompute drops the ``5as/(ht)`` attention-score term; full
recompute keeps ``2sbh`` (``/t`` with SP) per layer plus one layer's working set. The same
accounting is applied term by term to this library's Llama block (:func:`layer_terms`: SwiGLU,
grouped KV heads, no dropout, fused SDPA without stored scores). The number of micro-batches
alive on a rank is the schedule's promise (:func:`promised_in_flight`), counted in chunks of
``layers / (pp * V)`` layers, which includes interleaving's ``1 + (pp - 1)/(pp V)`` factor.

Allowance (stated, not fitted): 1 GiB for the CUDA context, cuBLAS and NCCL workspaces, plus 10%
of everything else for caching-allocator fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridpar.config import ModelConfig
from hybridpar.parallel.pipeline.partition import partition_model
from hybridpar.parallel.pipeline.schedules import Schedule, promised_in_flight
from hybridpar.planner.hardware import GiB
from hybridpar.planner.layout import Layout, Workload

CONTEXT_BYTES = 1 * GiB  # CUDA context + library workspaces
FRAGMENTATION = 0.10  # caching-allocator slack on top of live bytes

COMPONENTS = ("params", "grads", "optimizer", "activations", "logits", "comm_buffers", "overhead")


def padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def rank_param_shapes(model: ModelConfig, tp: int, pp: int, virtual_stages: int,
                      pp_rank: int) -> list[tuple[int, ...]]:
    """Shapes of the parameters pipeline rank ``pp_rank`` holds under tensor parallelism ``tp``:
    the runtime's Megatron split (vocabulary padded to a multiple of tp), partition by layer
    count, and a tied embedding's mirror on the last stage when pp > 1."""
    h, hd = model.dim, model.head_dim
    q, kv, f = model.n_heads * hd // tp, model.n_kv_heads * hd // tp, model.ffn_hidden // tp
    vocab = padded(model.vocab_size, tp) // tp
    layer = [(h,), (q, h), (kv, h), (kv, h), (h, q), (h,), (f, h), (f, h), (h, f)]
    shapes: list[tuple[int, ...]] = []
    part = partition_model(model, pp, virtual_stages)
    for chunk in part.for_rank(pp_rank):
        if chunk.embedding:
            shapes.append((vocab, h))
        shapes += layer * len(chunk.layers)
        if chunk.head:
            shapes.append((h,))
            if not model.tie_embeddings or pp > 1:
                shapes.append((vocab, h))
    return shapes


def numel(shapes: list[tuple[int, ...]], shards: int = 1) -> int:
    """Elements of the worst rank when every shape is split ``shards`` ways along dim 0."""
    total = 0
    for s in shapes:
        rest = 1
        for d in s[1:]:
            rest *= d
        total += -(-s[0] // shards) * rest
    return total


@dataclass(frozen=True)
class ModelStates:
    """Bytes of parameters, gradients and optimizer state on one rank (device and host)."""

    params: int
    grads: int
    optimizer: int
    cpu_optimizer: int = 0


def model_state_bytes(shapes: list[tuple[int, ...]], dp: int, zero_stage: int, param_bytes: int,
                      offload: bool = False) -> ModelStates:
    """Parameter, gradient and optimizer bytes of one rank holding ``shapes`` (see module doc)."""
    full, shard = numel(shapes), numel(shapes, dp)
    opt_per = 8 if param_bytes == 4 else 12  # Adam m, v (+ fp32 master with half params)
    params = param_bytes * (shard if zero_stage >= 3 else full)
    grads = param_bytes * (shard if zero_stage >= 2 else full)
    opt = opt_per * (shard if zero_stage >= 1 else full)
    return ModelStates(params, grads, 0 if offload else opt, opt if offload else 0)


# ----------------------------------------------------------------------------- activations


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Korthikanti et al. 2022, Table 2: activation bytes of one GPT layer (fp16, with
    dropout, unfused attention) for sequence ``s``, micro-batch ``b``, hidden ``h``, ``a``
    heads, tensor parallel ``t``. (Exact published formulas, for validation.)"""
    sbh = s * b * h
    score = 5 * a * s / (h * t)
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    keep = 0.0 if recompute == "selective" else score
    if sp:
        return sbh * (34 / t + keep)
    return sbh * (10 + 24 / t + keep)


@dataclass(frozen=True)
class LayerTerms:
    """Stored bytes per token of one layer in units of hidden size ``h`` (times 1 byte), split
    into the part every tp rank replicates (sharded only by SP), the part tp shards, and the
    attention-score part (``per token * s``; dropped by selective recompute)."""

    replicated: float
    sharded: float
    scores_per_s: float  # multiply by s * heads / h


def layer_terms(model: ModelConfig, style: str = "llama") -> LayerTerms:
    """Per-layer stored activations in bytes per token / h, following Korthikanti's accounting.

    ``gpt``: Korthikanti's block (2-byte activations, 1-byte dropout masks, 4h GELU MLP, scores
    stored): replicated 10 (two norm inputs 4, QKV input 2, MLP input 2, two dropout masks 2),
    sharded 24 (Q, K 4, V 2, output-projection input 2, GELU in/out 16), scores 5 (softmax 2,
    mask 1, dropout output 2). ``llama``: this library's block: no dropout, grouped KV heads,
    SwiGLU (w1, w3 outputs, silu output, product = 4 x 2f/h), attention output 2 (kept by the
    fused SDPA for its backward) and no stored scores."""
    h, kv, f = model.dim, model.n_kv_heads * model.head_dim, model.ffn_hidden
    if style == "gpt":
        # the preset's SwiGLU width f = 8h/3 stands for GPT's 4h GELU MLP (same parameters)
        return LayerTerms(10.0, 8.0 + 16.0 * (1.5 * f) / (4 * h), 5.0)
    attn = 2 + 2 * kv / h * 2 + 2 + 2  # Q, K, V, SDPA output, output-projection input
    return LayerTerms(4.0 + 2.0 + 2.0, attn + 8.0 * f / h, 0.0)


def layer_activation_bytes(model: ModelConfig, s: int, b: int, t: int, sp: bool, recompute: str,
                           style: str = "llama", act_bytes: int = 2) -> float:
    """Stored bytes of one layer for one micro-batch (``s`` tokens per rank per sequence)."""
    h, a = model.dim, model.n_heads
    terms = layer_terms(model, style)
    scale = act_bytes / 2  # the formulas count 2-byte activations
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh * scale / (t if sp else 1)
    scores = 0.0 if recompute == "selective" else terms.scores_per_s * a * s / h
    rep = terms.replicated / (t if sp else 1)
    return sbh * scale * (rep + (terms.sharded + scores) / t)


# ----------------------------------------------------------------------------- the whole rank


@dataclass
class MemoryReport:
    """Bytes of the worst pipeline rank by component (``COMPONENTS``), and where it is."""

    components: dict[str, float]
    worst_rank: int
    cpu_bytes: float = 0.0
    in_flight: int = 1  # micro-batch chunks alive on the worst rank
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(self.components.values())

    def gib(self) -> dict[str, float]:
        out = {k: round(v / GiB, 3) for k, v in self.components.items()}
        out["total"] = round(self.total / GiB, 3)
        return out


def rank_memory(model: ModelConfig, layout: Layout, work: Workload, pp_rank: int,
                style: str = "llama") -> MemoryReport:
    """Memory of pipeline rank ``pp_rank`` (see the module docstring for every term)."""
    L, t, pp, v = layout, layout.tp, layout.pp, layout.virtual_stages
    sp = L.sequence_parallel and t > 1
    shapes = rank_param_shapes(model, t, pp, v, pp_rank)
    st = model_state_bytes(shapes, L.dp, L.zero_stage, work.param_bytes, L.offload_optimizer)
    s = work.seq_len // L.cp
    b, h = L.micro_batch, model.dim
    m = L.microbatches(work.global_batch)
    part = partition_model(model, pp, v)
    chunks = part.for_rank(pp_rank)
    per_layer = layer_activation_bytes(model, s, b, t, sp, L.recompute, style, work.act_bytes)
    if pp > 1:
        in_flight = promised_in_flight(Schedule.parse(L.pipeline_schedule), pp, v, m, pp_rank)
    else:
        in_flight = 1  # gradient accumulation: one micro-batch at a time
    layers_per_chunk = max(len(c.layers) for c in chunks)
    acts = in_flight * layers_per_chunk * per_layer
    if L.recompute == "full":  # the layer being recomputed holds its full activations
        acts += layer_activation_bytes(model, s, b, t, sp, "none", style, work.act_bytes)
    ab = work.act_bytes
    logits = 0.0
    if any(c.embedding for c in chunks):  # embedding output, kept for the first layer's backward
        acts += in_flight * s * b * h * ab / (t if sp else 1)
    if any(c.head for c in chunks):
        vocab = padded(model.vocab_size, t) // t
        # Final-norm input and head input (Korthikanti 4.3: 4sbh/t) and the logits: matmul dtype
        # plus the fp32 copy the cross-entropy keeps (Korthikanti: 4sbv/t). The last stage runs
        # each micro-batch's backward right after its forward, so one micro-batch is alive.
        logits = 2 * s * b * h * ab / (t if sp else 1) + s * b * vocab * (ab + 4)
    comm = 0.0
    if L.dp * L.cp > 1 and L.zero_stage < 3:
        comm += 2 * work.bucket_mb * 2**20  # the gradient bucket being reduced and the one filling
    if L.zero_stage == 3:  # one gathered layer in use and the prefetched next one
        comm += 2 * work.param_bytes * numel(rank_param_shapes(model, t, 1, 1, 0)[1:10])
    if t > 1:  # the all-gathered (SP) or all-reduced activation of one block
        comm += 2 * s * b * h * ab
    if pp > 1:  # one send and one receive buffer per direction
        comm += 4 * s * b * h * ab / (t if sp else 1)
    if L.cp > 1:  # ring attention: the K and V blocks in use and the ones arriving
        comm += 2 * 2 * s * b * model.n_kv_heads * model.head_dim * ab / t
    live = st.params + st.grads + st.optimizer + acts + logits + comm
    overhead = CONTEXT_BYTES + FRAGMENTATION * live
    comps = {"params": float(st.params), "grads": float(st.grads), "optimizer": float(st.optimizer),
             "activations": acts, "logits": logits, "comm_buffers": comm, "overhead": overhead}
    return MemoryReport(comps, pp_rank, float(st.cpu_optimizer), in_flight)


def plan_memory(model: ModelConfig, layout: Layout, work: Workload, style: str = "llama") -> MemoryReport:
    """The pipeline rank with the largest total (the one that OOMs first), not the average."""
    reports = [rank_memory(model, layout, work, r, style) for r in range(layout.pp)]
    return max(reports, key=lambda rep: rep.total)
