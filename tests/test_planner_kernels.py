"""The planner's memory-bound and recompute terms against the kernels they price, counted op by
op on this runtime's eager Llama block with a TorchDispatchMode (``benchmarks/eager_bytes.py``):
the element-wise bytes per token in fp32, bf16 with half parameters and bf16 under autocast; the
bytes of one AdamW step per parameter; and torchtitan's op-level selective checkpointing policy
run through ``torch.utils.checkpoint`` on the block (what it keeps, to the byte, and which GEMMs
backward reruns)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from hybridpar.planner.cost import eager_elementwise_bytes
from hybridpar.planner.dp_cost import FOREACH_ADAMW_BYTES
from hybridpar.planner.sac import op_layer_bytes, recomputed_calls


def _bench():
    bench = str(Path(__file__).resolve().parent.parent / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module("eager_bytes")


# q (heads x head dim) differs from h, kv from both: each width's coefficient shows
WIDTHS = (256, 4, 2, 48, 512)  # h, heads, kv heads, head dim, ffn hidden
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
