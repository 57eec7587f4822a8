"""Activation bytes of one decoder layer per micro-batch, by block style.

Activations depend on the workload's block style (``Workload.style``, a
:class:`~hybridpar.planner.model.layout.BlockStyle`). ``BlockStyle.MEGATRON`` (Megatron-LM's GPT block)
follows Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
Table 2): GPT blocks store ``sbh(34 + 5as/h)`` bytes; with tensor parallelism
``sbh(10 + 24/t + 5as/(ht))``; plus sequence parallelism ``sbh(34/t + 5as/(ht))``; selective
recompute drops the ``5as/(ht)`` score term; full recompute keeps ``2sbh`` (``/t`` with SP) per
layer plus one layer's working set.

``BlockStyle.EAGER`` (the default) is this library's block tensor by tensor, as autograd saves it
(checked against the runtime's saved tensors, ``tests/test_planner_validation.py``). With ``r``
the residual-stream bytes (the parameter dtype: 4, or 2 with half parameters) and ``a`` the
matmul bytes, per token:

* each RMSNorm keeps its fp32 input (``4h``; the residual itself when ``r = 4``), its normalised
  output (``r h``), ``rsqrt`` (4 bytes) and, for the column-parallel layers it feeds, their input:
  one shared ``a h`` tensor, but under autocast (``a != r``) every layer keeps its own cast copy
  (3 for q/k/v, 2 for w1/w3). Under SP the norm runs on ``s/t`` tokens but the all-gathered
  input the linears keep is full length;
* attention keeps q, k, v and the fused-SDPA output (``a(2q + 2kv)/t``, q = heads x head dim) and its fp32 log-sum-exp
  (``4 heads/t``); no scores. Ring attention (cp) re-lays its output out for ``wo``: ``+a q/t``;
* the SwiGLU MLP keeps w1 and w3 outputs, the SiLU output and the product: ``4 a f/t``.

``BlockStyle.COMPILED`` (``train.compile``) keeps what Inductor's partitioner saves
(:func:`compiled_layer_bytes`): about 40% less than eager at Llama shapes, since it recomputes
the norms' outputs, casts and SiLU in backward. That holds for a block compiled as one graph;
with tp or cp its collectives split it into pieces, and MoE routing breaks it too, so those keep
the eager set.

Under ``fp8.recipe`` the FP8 linears keep quantized (tensorwise) or high-precision (rowwise)
inputs instead of autocast's casts (:func:`fp8_layer_delta`). An MoE layer's feed-forward
replaces the dense MLP's with :func:`moe_ffn_bytes` at the busiest ep rank's load. :mod:`hybridpar.planner.memory.plan` adds the per-chunk terms and counts the live sets.
"""

from __future__ import annotations

import functools
import math

from hybridpar.config import ModelConfig
from hybridpar.planner.model.layout import (
    BlockStyle,
    Layout,
    ModelKey,
    Workload,
    model_key,
    model_of,
)
from hybridpar.planner.model.mla import mla_shapes
from hybridpar.planner.model.moe import dispatch_rows, ffn_shapes, rank_load
from hybridpar.planner.model.sac import op_layer_bytes
from hybridpar.planner.model.shapes import padded


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


def gpt_layer_bytes(model: ModelConfig, s: int, b: int, t: int, sp: bool, recompute: str,
                    act_bytes: int = 2) -> float:
    """Korthikanti's GPT block term by term (2-byte activations, 1-byte dropout masks, 4h GELU
    MLP, scores stored), per micro-batch: replicated 10 (two norm inputs 4, QKV input 2, MLP
    input 2, two dropout masks 2), sharded 24 (Q, K 4, V 2, output-projection input 2, GELU
    in/out 16), scores 5 per ``s * heads / h`` (softmax 2, mask 1, dropout output 2). The preset's
    SwiGLU width ``f = 8h/3`` stands for GPT's 4h GELU MLP (same parameters)."""
    h, a, f = model.dim, model.n_heads, model.ffn_hidden
    sbh, scale = s * b * h, act_bytes / 2
    if recompute == "full":
        return 2 * sbh * scale / (t if sp else 1)
    sharded = 8.0 + 16.0 * (1.5 * f) / (4 * h)
    scores = 0.0 if recompute == "selective" else 5.0 * a * s / h
    return sbh * scale * (10.0 / (t if sp else 1) + (sharded + scores) / t)


def llama_layer_bytes(model: ModelConfig, s: int, b: int, t: int, sp: bool, recompute: str,
                      act_bytes: int = 2, residual_bytes: int | None = None, cp: int = 1) -> float:
    """Bytes one decoder layer of :class:`hybridpar.models.llama.Llama` keeps for backward, per
    micro-batch of ``b`` sequences of ``s`` tokens on this rank (module docstring). Full
    recompute keeps the layer input. Selective recompute reruns the attention core, which then
    keeps neither its fp32 log-sum-exp nor (ring attention) its own output copy; the fused
    output itself stays, as the input ``wo`` keeps (the fused attention keeps no scores to drop)."""
    a, r = act_bytes, act_bytes if residual_bytes is None else residual_bytes
    h, kv, f, heads = model.dim, model.n_kv_heads * model.head_dim, model.ffn_hidden, model.n_heads
    shard = t if sp else 1
    if recompute == "full":
        return s * b * r * h / shard
    autocast = a != r

    def norm(consumers: int) -> float:
        return ((4 + r) * h + 4) / shard + (consumers if autocast else 1) * a * h

    q = model.n_heads * (model.qk_nope_head_dim + model.qk_rope_head_dim if model.mla else model.head_dim)
    core = 0.0 if recompute == "selective" else 4 * heads / t + (a * q / t if cp > 1 else 0.0)
    if model.mla:
        attn = mla_attention_bytes(model, a, t, recompute == "selective") + core
        return s * b * (norm(2) + norm(2) + attn + 4 * a * f / t)
    attn = a * (2 * q + 2 * kv) / t + core  # q and the output: heads x head dim
    return s * b * (norm(3) + norm(2) + attn + 4 * a * f / t)


def mla_attention_bytes(model: ModelConfig, a: int, t: int, selective: bool) -> float:
    """Bytes per token DeepSeek-V3's latent attention (:class:`~hybridpar.models.deepseek_v3.MLAttention`)
    keeps for backward besides its input norm and the core's log-sum-exp: each inner RMSNorm
    (``q_norm`` over ``q_lora_rank``, ``kv_norm`` over ``kv_lora_rank``, on every tp rank) its fp32
    input, ``rsqrt``, its output cast back and the up-projection's input, ``(4 + 2a) n + 4`` (in
    fp32 the input is a view of ``wkv_a``'s output, whose rope key columns come along); the fused
    core's q, k and the values padded to ``qk`` channels (``3 a H qk / t``), its output (not under
    selective recompute, which reruns the core) and ``wo``'s input, a copy of the output's first
    ``v_head_dim`` channels (``a H v / t``)."""
    heads, qk = model.n_heads / t, model.qk_nope_head_dim + model.qk_rope_head_dim
    q_norm = (4 + 2 * a) * model.q_lora_rank + 4 if model.q_lora_rank else 0
    kv_norm = (4 + 2 * a) * model.kv_lora_rank + 4 + (4 * model.qk_rope_head_dim if a == 4 else 0)
    return q_norm + kv_norm + a * heads * ((3 if selective else 4) * qk + model.v_head_dim)


def compiled_layer_bytes(model: ModelConfig, s: int, b: int, recompute: str, act_bytes: int = 2,
                         residual_bytes: int | None = None) -> float:
    """Bytes one decoder layer keeps for backward under ``train.compile`` (Inductor's min-cut
    partitioner, one graph per block: tp = cp = 1), per micro-batch of ``b`` sequences of ``s``
    tokens. The partitioner saves fewer tensors than eager autograd and recomputes the cheap
    element-wise ones (norm outputs, casts, SiLU) in backward; per token it keeps the block's input
    (``r h``), three half-precision h-wide tensors (the two norms' outputs, one shared cast each,
    and the attention projection's output), q and the attention output (``2 a q``), k and v
    (``2 a kv``), three f-wide ones (w1's and w3's outputs and their SwiGLU product), the fp32
    log-sum-exp (``4`` per head; not under selective recompute) and the norms' two fp32 ``rsqrt``.
    Listed with saved-tensor hooks on the compiled block (``benchmarks/planner_kernels.py``;
    ``tests/test_planner_kernels.py``: equal to the byte on this machine's CPU)."""
    a, r = act_bytes, act_bytes if residual_bytes is None else residual_bytes
    h, kv, f, heads = model.dim, model.n_kv_heads * model.head_dim, model.ffn_hidden, model.n_heads
    if recompute == "full":
        return s * b * r * h
    lse = 0 if recompute == "selective" else 4 * heads
    return s * b * (r * h + 3 * a * h + 2 * a * model.n_heads * model.head_dim + 2 * a * kv + 3 * a * f + lse + 8)


def moe_ffn_bytes(model: ModelConfig, s: int, b: int, t: int, sp: bool, act_bytes: int,
                  residual_bytes: int, ep: int, load: float) -> float:
    """Bytes an MoE layer's ``ffn_norm`` and feed-forward keep for backward per micro-batch of
    ``T = b s`` tokens in the tp group (``T / t`` on the rank under SP), as autograd saves them
    in :class:`hybridpar.models.moe.MoE` and :class:`hybridpar.parallel.experts.ExpertParallel`:

    * the norm as in the dense layer, and the router's input (its cast under autocast), on the
      rank's own tokens; the router's fp32 softmax ``4E``, top-k ids ``8k``, the weights and
      their sum ``4k + 4``, with the z-loss its fp32 logits and log-sum-exp ``4E + 4``;
    * over the tp group's ``kT`` slots: the slot order and token ids (int64, ``16 kT``), the
      expert outputs back from the combine, their weights and the weighted rows ``index_add``
      keeps, ``a kT (2 D + 1)``;
    * over the ``R = load * kT`` rows this rank's experts compute
      (:func:`hybridpar.planner.model.moe.dispatch_rows`): their input ``a R D``, the SwiGLU's two
      projections, SiLU and product ``4 a R H / t``, and with ep > 1 the two int64 row
      permutations around the expert computation ``16 R``;
    * shared experts as a dense MLP of ``n_shared * H``: ``4 a`` per hidden element, plus their
      all-gathered (SP) or cast (autocast) input."""
    a, r, h = act_bytes, residual_bytes, model.dim
    shard = t if sp else 1
    autocast = a != r
    e, k = model.n_experts, model.experts_per_token
    tok = s * b
    z = 4 * e + 4 if model.z_loss_coef else 0
    local = (((4 + r) * h + 4) + a * h + 4 * e + 12 * k + 4 + z) / shard
    slots = k * (16 + a * (2 * h + 1))
    _, _, rows = dispatch_rows(tok, k, ep, load)
    expert = rows * (a * h + 4 * a * model.expert_hidden / t + (16 if ep > 1 else 0))
    shared = 0.0
    if model.n_shared_experts:
        inp = (2 if autocast else 1) * a * h if (sp or autocast) else 0
        shared = tok * (inp + 4 * a * model.n_shared_experts * model.expert_hidden / t)
    return tok * (local + slots) + expert + shared


def layer_activation_bytes(model: ModelConfig, layout: Layout, work: Workload,
                           recompute: str | None = None, moe: bool = False) -> float:
    """Stored bytes of one layer for one micro-batch of ``layout`` (``seq_len / cp`` tokens per
    rank per sequence, sequence parallelism when on and tp > 1), with ``layout.recompute`` or
    the ``recompute`` given: :func:`gpt_layer_bytes` for ``BlockStyle.MEGATRON``, else
    :func:`llama_layer_bytes`, with ``work``'s activation and parameter bytes (selective under
    ``work.selective_ac = "op"``: :func:`hybridpar.planner.model.sac.op_layer_bytes`; the compiled block
    as one graph: :func:`compiled_layer_bytes`). ``moe``: an MoE
    layer, whose feed-forward (:func:`moe_ffn_bytes`, at the busiest ep rank's load) replaces the
    dense MLP's (unless fully recomputed: then only the layer input is kept either way)."""
    rec = layout.recompute if recompute is None else recompute
    return _layer_activation_bytes(model_key(model), layout.tp, layout.cp, layout.micro_batch,
                                   layout.sequence_parallel, layout.ep, rec, work, moe)


@functools.lru_cache(maxsize=65536)
def _layer_activation_bytes(key: ModelKey, t: int, cp: int, b: int, sequence_parallel: bool, ep: int,
                            rec: str, work: Workload, moe: bool) -> float:
    """:func:`layer_activation_bytes` of the fields it reads, memoised: the search asks for the same
    layer under every pipeline rank, chunk, schedule and ZeRO stage of a candidate."""
    model = model_of(key)
    s, sp = work.seq_len // cp, sequence_parallel and t > 1
    a, r = work.act_bytes, work.param_bytes
    if work.style is BlockStyle.MEGATRON:
        dense = gpt_layer_bytes(model, s, b, t, sp, rec, a)
    elif rec == "selective" and work.selective_ac == "op":  # torchtitan's op-level policy (.sac); an
        # MoE layer keeps its attention half by the policy and its feed-forward as without recompute
        h, kv = model.dim, model.n_kv_heads * model.head_dim
        dense = op_layer_bytes(s, b, h, model.n_heads * model.head_dim, kv, model.ffn_hidden, model.n_heads, t, sp, a, r)
        if moe:
            dense -= s * b * a * (model.ffn_hidden / t + h)
            load = rank_load(work.moe_imbalance, ep, model.n_experts)
            dense += moe_ffn_bytes(model, s, b, t, sp, a, r, ep, load)
        return dense
    elif work.style is BlockStyle.COMPILED and t == 1 and cp == 1 and not moe:  # one graph per block
        return compiled_layer_bytes(model, s, b, rec, a, r)
    else:  # eager; compiled blocks split at collectives (tp, cp) or MoE routing keep the eager set
        dense = llama_layer_bytes(model, s, b, t, sp, rec, a, r, cp)
        if rec != "full":
            dense += fp8_layer_delta(model, s, b, t, work.fp8, a, r, moe)
    if not moe or rec == "full":
        return dense
    norm = ((4 + r) * model.dim + 4) / (t if sp else 1) + (2 if a != r else 1) * a * model.dim
    dense_ffn = s * b * (norm + 4 * a * model.ffn_hidden / t)
    load = rank_load(work.moe_imbalance, ep, model.n_experts)
    return dense - dense_ffn + moe_ffn_bytes(model, s, b, t, sp, a, r, ep, load)


def mtp_activation_bytes(model: ModelConfig, layout: Layout, work: Workload) -> float:
    """Bytes the multi-token prediction modules (:class:`~hybridpar.models.deepseek_v3.MTP`) keep
    for backward per micro-batch of ``T = b s`` tokens on the rank with the head. Per module ``k``
    and token: the rolled token ids (int64);
    ``enorm`` and ``hnorm`` each its fp32 input (``hnorm``'s is, in fp32 without autocast, the final
    norm's output the head already keeps), ``rsqrt`` and normalised output ``r h``; ``eh_proj``'s
    input ``2 a h``; a decoder layer (:func:`layer_activation_bytes`, an MoE layer's when the model
    has experts); the output norm and the logits' input, as the final norm; and ``F.cross_entropy``'s
    fp32 log-softmax (of this rank's vocabulary share) and targets on every position (those
    without a target in the sequence are ignored). Under autocast: the projection's and the layer's half weight copies."""
    s, b, h, a, r = work.seq_len // layout.cp, layout.micro_batch, model.dim, work.act_bytes, work.param_bytes
    autocast, vocab = a != r, model.vocab_size
    hnorm_in = 0 if r == 4 and not autocast else 4 * h
    per_token = 8 + (4 * h + 4 + r * h) + (hnorm_in + 4 + r * h) + 2 * a * h + ((4 + r) * h + 4) + a * h
    layer = layer_activation_bytes(model, layout, work, moe=model.n_experts > 0)
    like = model.moe_layer_ids()[0] if model.n_experts else -1  # -1: a dense layer
    casts = a * 2 * h * h + layer_weight_cast_bytes(model, like, layout.tp, layout.ep, a) if autocast else 0.0
    vocab = padded(vocab, layout.tp) // layout.tp
    loss = model.mtp_layers * (b * s * (4 * vocab + 8) + 4)
    return model.mtp_layers * (s * b * per_token + layer + casts) + loss


def layer_weight_cast_bytes(model: ModelConfig, layer: int, tp: int, ep: int, act_bytes: int,
                            fp8: str = "none") -> float:
    """Half copies of one layer's matmul weights that autocast (and the experts' explicit
    casts) keep per forward: q/k/v/o (latent attention's projections), and the MLP or the router,
    routed and shared experts. ``fp8`` (``fp8.recipe``): its linears (attention, a dense MLP) keep
    their weight quantized, 1 byte per element (tensorwise), or the master weight itself
    (rowwise), instead (latent attention's projections too: every linear of a block is FP8)."""
    h, q, kv = model.dim, model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    ffn = sum(math.prod(s) for n, s in ffn_shapes(model, layer, tp, ep))
    per = {"none": act_bytes, "tensorwise": 1, "rowwise": 0}[fp8]
    mlp = (per if layer not in model.moe_layer_ids() else act_bytes) * ffn
    if model.mla:
        return per * sum(math.prod(s) for _, s in mla_shapes(model, tp) if len(s) == 2) + mlp
    return per * (2 * h * q + 2 * h * kv) / tp + mlp


def fp8_layer_delta(model: ModelConfig, s: int, b: int, t: int, recipe: str, act_bytes: int,
                    residual_bytes: int, moe: bool) -> float:
    """What ``fp8.recipe``'s linears (:mod:`hybridpar.parallel.fp8`) change in one layer's saved
    bytes under autocast, per micro-batch (weights aside: :func:`layer_weight_cast_bytes`).
    Tensorwise: each linear saves its own 1-byte quantized input where autocast kept a cast copy
    (q/k/v, w1/w3), ``wo`` one beside the attention output the kernel keeps, ``w2`` one instead
    of the SwiGLU product. Rowwise: the high-precision input itself, once per group sharing it
    (the norm's output, full length under SP), and no cast. An MoE layer's experts stay bf16:
    only its attention changes."""
    a, r, h, q, f = act_bytes, residual_bytes, model.dim, model.n_heads * model.head_dim, model.ffn_hidden
    if recipe == "none" or a == r:
        return 0.0
    copies, groups = (3, 1) if moe else (5, 2)
    if recipe == "tensorwise":
        return s * b * (copies * (1 - a) * h + q / t + (0 if moe else (1 - a) * f / t))
    return s * b * (groups * r * h - copies * a * h)


def deferred_layer_bytes(model: ModelConfig, t: int, act_bytes: int, residual_bytes: int) -> tuple[float, float]:
    """``(inputs, grads)``: bytes per token one Llama layer keeps from ZB-H1's B to its W
    (:mod:`hybridpar.parallel.pipeline.wsplit`): each linear's saved input (the normed input
    shared by q/k/v, and by w1/w3, one cast copy per linear under autocast; the attention output
    ``wo`` reads; the SwiGLU product ``w2`` reads) and each linear's output gradient (q, k, v,
    w1, w3 sharded over tp; ``wo`` and ``w2`` full-width partial sums, full-length under SP)."""
    a, h, f = act_bytes, model.dim, model.ffn_hidden
    q, kv = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    autocast = a != residual_bytes
    inputs = (3 if autocast else 1) * a * h + a * q / t + (2 if autocast else 1) * a * h + a * f / t
    grads = a * (q + 2 * kv + 2 * f) / t + 2 * a * h
    return inputs, grads


# The chunked loss (hybridpar.parallel.loss) keeps per token the max and sum of exponentials
# (fp32), the local target index (int64) and two masks: never the logits or their softmax.
CHUNKED_LOSS_TOKEN_BYTES = 4 + 4 + 8 + 1 + 1


def loss_chunked(work: Workload, tokens: int) -> bool:
    """Whether the loss of a micro-batch of ``tokens`` tokens per rank at the head runs chunked
    (``train.loss_chunk_tokens``: more tokens than one chunk)."""
    return 0 < work.loss_chunk_tokens < tokens


def _loss_bytes(work: Workload, tok: int, t: int, vocab: int) -> float:
    """What the loss saves for backward, per micro-batch (the head's input and weight aside)."""
    if loss_chunked(work, tok):  # per-token statistics, and the token count of the mean
        return tok * CHUNKED_LOSS_TOKEN_BYTES + 8
    if t == 1:  # F.cross_entropy: fp32 log-softmax, targets, total weight
        return tok * (4 * vocab + 8) + 4
    return tok * (4 * vocab + 10) + 8  # vocab-parallel: fp32 softmax, local target index, two masks, token count


def loss_backward_bytes(L: Layout, work: Workload, vocab: int, dim: int = 0) -> float:
    """What the unchunked loss's backward holds beside what it saved, at its peak, per
    micro-batch (``vocab``: the rank's share): at tp = 1 ``F.cross_entropy``'s ``nll_loss``
    backward writes a dense fp32 gradient and ``log_softmax``'s backward its fp32 result, both
    beside the saved log-softmax (8 bytes per token and vocabulary entry); the vocab-parallel
    loss, its fp32 gradient beside the saved softmax (4). Measured: a CPU step's peak of live
    bytes (``benchmarks/planner_kernels.py``) exceeds the saved tensors by exactly this. None for the
    chunked loss (one chunk's logits at a time) and Megatron-LM's block (its loss writes the
    gradient into the saved softmax). The chunked loss: :func:`chunked_loss_backward_bytes`
    (with the model's ``dim``; 0 without it)."""
    tok = L.micro_batch * (work.seq_len // L.cp)
    if work.style is BlockStyle.MEGATRON:
        return 0.0
    if loss_chunked(work, tok):
        return chunked_loss_backward_bytes(tok, work.loss_chunk_tokens, vocab, dim, work.act_bytes) if dim else 0.0
    return tok * vocab * (8 if L.tp == 1 else 4)


def chunked_loss_backward_bytes(tok: int, chunk: int, vocab: int, dim: int, ab: int) -> float:
    """What the chunked loss's backward (:class:`hybridpar.parallel.loss._ChunkedHeadCrossEntropy`)
    holds beside what it saved, at its peak: the masked output gradient (fp32 per token), the input
    gradient (``tok x dim``, matmul dtype) and the fp32 weight gradient (``vocab x dim``), and the
    largest of one chunk's steps: the recomputed logits and their fp32 copy, the fp32 softmax
    beside them (8 bytes per chunk token and vocabulary entry), its cast to the matmul dtype, the
    weight-gradient product (``vocab x dim``) beside the cast chunk, and at the end the weight
    gradient's cast. Found by ``hybridpar train --dry-run`` (Llama-3.1-8B's peak was 6% over)."""
    c = min(chunk, tok)
    held = 4 * tok + ab * tok * dim + 4 * vocab * dim
    steps = [c * vocab * (ab + 4) if ab != 4 else 0, 8 * c * vocab, (4 + ab) * c * vocab if ab != 4 else 0,
             ab * c * vocab + ab * vocab * dim, ab * vocab * dim if ab != 4 else 0]
    return held + max(steps)
