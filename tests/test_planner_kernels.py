"""The planner's memory-bound and recompute terms against the kernels they price, counted op by
op on this runtime's eager Llama block with a TorchDispatchMode (``benchmarks/planner_kernels.py``):
the element-wise bytes per token in fp32, bf16 with half parameters and bf16 under autocast; the
bytes of one AdamW step per parameter; and torchtitan's op-level selective checkpointing policy
run through ``torch.utils.checkpoint`` on the block (what it keeps, to the byte, and which GEMMs
backward reruns)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from hybridpar.planner.memory.activations import compiled_layer_bytes, llama_layer_bytes
from hybridpar.planner.memory.plan import loss_backward_bytes, plan_memory
from hybridpar.planner.model.layout import from_config
from hybridpar.planner.model.sac import op_layer_bytes, recomputed_calls
from hybridpar.planner.price.cost import eager_elementwise_bytes
from hybridpar.planner.price.dp_cost import FOREACH_ADAMW_BYTES


def _bench():
    bench = str(Path(__file__).resolve().parent.parent / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module("planner_kernels")


# q (heads x head dim) differs from h, kv from both: each width's coefficient shows
WIDTHS = (256, 4, 2, 48, 512)  # h, heads, kv heads, head dim, ffn hidden (no activation of a weight's shape)
MODE_BYTES = {"fp32": (4, 4), "half": (2, 2), "autocast": (2, 4)}  # (matmul bytes, residual bytes)


@pytest.mark.parametrize("mode", list(MODE_BYTES))
def test_eager_elementwise_bytes_match_the_block(mode):
    """eager_elementwise_bytes within 3% of the bytes the block's element-wise ops move (its
    formula leaves out a few bytes per token: the RoPE tables' reads, per-row statistics)."""
    eb = _bench()
    h, heads, kv_heads, d, f = WIDTHS
    fwd, bwd = eb.elementwise_bytes(eb.llama_shape(*WIDTHS, 250), mode)
    pf, pb = eager_elementwise_bytes(h, heads * d, kv_heads * d, f, *MODE_BYTES[mode])
    assert pf == pytest.approx(fwd, rel=0.03)
    assert pb == pytest.approx(bwd, rel=0.03)


def test_adamw_bytes_per_parameter():
    """One torch AdamW step moves FOREACH_ADAMW_BYTES per fp32 parameter."""
    assert _bench().adamw_bytes_per_param() == pytest.approx(FOREACH_ADAMW_BYTES, rel=1e-3)


@pytest.mark.parametrize("mode", list(MODE_BYTES))
def test_op_sac_keeps_and_reruns_what_the_planner_prices(mode):
    """torchtitan's op-level policy on the block: what it keeps equals op_layer_bytes to the
    byte, and backward reruns the GEMMs recomputed_calls names (wk, wo, w3), in order."""
    eb = _bench()
    h, heads, kv_heads, d, f = WIDTHS
    batch, seq = 2, 64
    kept, rerun = eb.op_sac_block(eb.llama_shape(*WIDTHS, seq), mode, batch, seq)
    a, r = MODE_BYTES[mode]
    q, kv, tok = heads * d, kv_heads * d, batch * seq
    assert kept == op_layer_bytes(seq, batch, h, q, kv, f, heads, 1, False, a, r)
    gemms = [(tok, q, h), (tok, kv, h), (tok, kv, h), (tok, h, q), (tok, f, h), (tok, f, h), (tok, h, f)]
    assert rerun == [(m, n, k) for c, m, n, k in recomputed_calls([(1.0, *g) for g in gemms]) for _ in range(int(c))]


@pytest.mark.parametrize("mode", list(MODE_BYTES))
def test_block_saves_what_the_planner_prices(mode):
    """The eager block's saved tensors equal llama_layer_bytes, and the compiled block's (Inductor's
    decompositions and min-cut partitioner) compiled_layer_bytes, to the byte (q != h: the query
    width is heads x head dim)."""
    eb = _bench()
    cfg = eb.llama_shape(*WIDTHS, 100)
    a, r = MODE_BYTES[mode]
    assert eb.saved_bytes(cfg, mode, batch=2, seq=100) == llama_layer_bytes(cfg, 100, 2, 1, False, "none", a, r)
    compiled = eb.saved_bytes(cfg, mode, "partitioner", batch=2, seq=100)
    assert compiled == compiled_layer_bytes(cfg, 100, 2, "none", a, r)


@pytest.mark.parametrize("global_batch", [2, 4])
def test_step_peak_holds_the_loss_backward(global_batch):
    """A bf16 CPU training's peak of live tensor bytes (profiler memory events) equals the
    planner's live bytes (every component but the allocator's overhead) within 1%, with one
    micro-batch per step (the gradients, dropped at zero_grad, do not exist yet at the peak) and
    with two (they do). The peak is the unchunked loss's backward: without loss_backward_bytes the
    planner would be 20% short."""
    eb = _bench()
    flags = ["--model.dim", "192", "--model.n_layers", "2", "--model.n_heads", "12", "--model.n_kv_heads", "4",
             "--model.ffn_hidden", "512", "--model.vocab_size", "4000", "--model.max_seq_len", "256",
             "--train.seq_len", "256", "--train.global_batch", str(global_batch), "--train.micro_batch", "2",
             "--train.precision", "bf16", "--train.loss_chunk_tokens", "0", "--train.eval_batches", "1",
             "--train.sample_tokens", "16"]
    peak, cfg = eb.step_peak_bytes(flags)
    layout, work = from_config(cfg)
    mem = plan_memory(cfg.model, layout, work)
    assert (mem.components["grads"] == 0) == (global_batch == 2)
    assert mem.total - mem.components["overhead"] == pytest.approx(peak, rel=0.01)
    assert loss_backward_bytes(layout, work, cfg.model.vocab_size) > 0.2 * peak
