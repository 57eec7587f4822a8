"""Op-level selective activation checkpointing, priced for the planner only.

Two runtimes call different policies "selective". This runtime's ``parallel.recompute =
"selective"`` is Korthikanti et al.'s: rerun the attention core in backward, keep everything
else (``Workload.selective_ac = "attention"``, the default). torchtitan's ``activation_checkpoint.mode
= "selective"`` with ``selective_ac_option = "op"`` (``Workload.selective_ac = "op"``) is an
op-level policy (``torch.utils.checkpoint.create_selective_checkpoint_contexts``). It is defined
in ``torchtitan/parallelisms/parallelize_llama.py`` at 9dec370, the commit of torchtitan's
``benchmarks/llama3_h100_202412_torchtitan.md``:

* ``_save_list = {aten.mm, aten._scaled_dot_product_flash_attention,
  aten._scaled_dot_product_efficient_attention, _c10d_functional.reduce_scatter_tensor,
  aten.abs, aten.max}``;
* the policy counts the block's ``aten.mm`` calls (a fresh count per block and per forward). It
  saves (``MUST_SAVE``) the output of every op in the list except every second mm. Every other op
  is ``PREFER_RECOMPUTE``; under ``torch.compile`` the min-cut partitioner treats that tag as
  must-recompute.

In the Llama block (mm order ``wq, wk, wv, wo, w1, w3, w2``) it keeps the outputs of ``wq``,
``wv``, ``w1`` and ``w2``, the attention output and its log-sum-exp, and the block's input (the
checkpoint's own). Backward reruns the ``wk``, ``wo`` and ``w3`` GEMMs, about 37% of the
block's forward GEMM FLOPs at Llama 3.1 8B's shapes, and all of its element-wise work. Under
tensor parallelism it also reruns the forward collectives that are not in the list: all-gathers
under SP, all-reduces without.

This runtime has no op-level policy. ``"op"`` exists so that published rows measured with it
(torchtitan's tables) are priced as they ran, and the search never proposes it for this runtime:
:func:`hybridpar.planner.model.layout.from_config` plans the runtime's ``"attention"``.
"""

from __future__ import annotations

SELECTIVE_AC = ("attention", "op")


def recomputed_calls(counted: list[tuple[float, float, float, float]]) -> list[tuple[float, float, float, float]]:
    """The GEMMs the op policy reruns in backward: of a block's forward GEMM calls ``(count, m,
    n, k)`` in call order, the even-numbered ones (the 2nd, 4th, ...), as ``(count, m, n, k)``."""
    out, done = [], 0
    for c, m, n, k in counted:
        calls = int(round(c))
        even = (done + calls) // 2 - done // 2  # even call numbers among done + 1 .. done + calls
        if even:
            out.append((float(even), m, n, k))
        done += calls
    return out


def recomputed_gemm_params(model_dim: int, q: int, kv: int, ffn: int) -> int:
    """Matmul parameters of a Llama layer whose GEMMs the op policy reruns: ``wk`` (h x kv),
    ``wo`` (q x h) and ``w3`` (h x ffn), the 2nd, 4th and 6th of ``wq, wk, wv, wo, w1, w3, w2``."""
    return model_dim * kv + q * model_dim + model_dim * ffn


def op_layer_bytes(s: int, b: int, h: int, q: int, kv: int, f: int, heads: int, t: int, sp: bool,
                   act_bytes: int, residual_bytes: int) -> float:
    """Bytes one Llama layer keeps for backward under the op policy per micro-batch of ``b``
    sequences of ``s`` tokens on the rank (module doc). Per token: the block's input
    (``residual_bytes``, sequence-sharded under SP), the kept GEMM outputs (``wq`` q/t, ``wv``
    kv/t, ``w1`` f/t, and ``w2``'s full-width partial sum h), the fused attention's output (q/t)
    and fp32 log-sum-exp (4 per head), and under SP the two reduce-scatters' outputs (h/t
    each)."""
    a, shard = act_bytes, t if sp else 1
    kept = a * (q + kv + f + q) / t + a * h + 4 * heads / t
    scattered = 2 * a * h / t if sp else 0.0
    return s * b * (residual_bytes * h / shard + kept + scattered)


def check_selective_ac(value: str) -> None:
    """``ValueError`` for a ``Workload.selective_ac`` outside :data:`SELECTIVE_AC`."""
    if value not in SELECTIVE_AC:
        raise ValueError(f"selective_ac {value!r}: expected one of {list(SELECTIVE_AC)}")
