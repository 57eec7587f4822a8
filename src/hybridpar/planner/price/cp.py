"""Context parallelism's modes priced: ring attention, Ulysses all-to-all and the hybrid (USP).

A cp axis of ``n = u * r`` ranks runs Ulysses inside groups of ``u`` consecutive cp ranks and
ring attention across the ``r`` groups (:mod:`hybridpar.parallel.ulysses`); ring is ``u = 1``,
Ulysses ``r = 1``. Per layer and micro-batch of ``b`` sequences, with ``s = seq / cp`` tokens on the
rank, ``H = n_heads / tp`` heads, ``K = n_kv_heads / tp`` KV heads (``K' = max(K, u)`` under
Ulysses: KV heads replicated up to the degree), head size ``d`` and attention-input bytes ``a``,
the payload the comm counter records (:func:`cp_collectives`):

* ring, over ``r`` ranks (axis ``cp``, or ``cp.ring`` in the hybrid): the K/V block ``2 b s K' d``
  travels ``r - 1`` hops forward; backward K/V again and the fp32 dK/dV blocks, each sent and
  received: ``(r - 1) 2 b s K' d (a | 2a + 4)`` per direction;
* Ulysses, over ``u`` ranks (axis ``cp``, or ``cp.ulysses``): one all-to-all of q, k, v together
  (``b s (H + 2K') d a``) and one of the output (``b s H d a``) forward, the same two reversed
  backward; every rank sends ``(u - 1) / u`` of each.

Recomputation reruns the forward ones (selective: all but the output's all-to-all, whose
result no saved tensor needs). Ring's bytes grow with ``r`` while
each hop hides behind a block of attention; Ulysses' do not grow with ``u`` (``(u-1)/u`` of a
fixed tensor) but sit on the critical path and need ``u`` to divide the heads. Which wins is a
matter of bandwidth and head count: :func:`choose_cp_mode` times each legal mode's layer with
:func:`hybridpar.planner.price.cost.layer_time` and keeps the fastest (ring on a tie).
"""

from __future__ import annotations

from collections.abc import Callable

from hybridpar.config import ModelConfig
from hybridpar.planner.machine.hardware import Cluster
from hybridpar.planner.model.layout import Layout, Workload
from hybridpar.planner.price.rates import all_to_all_time

Adder = Callable[..., None]  # traffic.py's add(op, axis, axis size, payload bytes, times=1)


def axis_names(L: Layout) -> tuple[str, str]:
    """The comm counter's names of the (Ulysses, ring) sides of cp: ``cp`` for a side spanning
    all of it (``Topology.split_axis``), else ``cp.ulysses`` / ``cp.ring``."""
    u, r = L.cp_split()
    return ("cp" if u == L.cp else "cp.ulysses"), ("cp" if r == L.cp else "cp.ring")


def kv_heads(model: ModelConfig, L: Layout) -> int:
    """KV heads per tp rank as the attention sees them: replicated up to the Ulysses degree."""
    u, kv = L.cp_split()[0], model.n_kv_heads // L.tp
    return max(kv, u) if u > 1 else kv


def cp_bytes(model: ModelConfig, L: Layout, work: Workload) -> tuple[int, int, int]:
    """Per layer and micro-batch on one rank: (ring K/V block ``2 b s K' d``, one forward's
    Ulysses all-to-all payload ``b s (2H + 2K') d a``, ring hops ``r - 1``)."""
    u, r = L.cp_split()
    s, b, d = work.seq_len // L.cp, L.micro_batch, model.head_dim
    block = 2 * b * s * kv_heads(model, L) * d
    a2a = b * s * (2 * model.n_heads // L.tp + 2 * kv_heads(model, L)) * d * work.act_bytes if u > 1 else 0
    return block, a2a, r - 1


def _out_bytes(model: ModelConfig, L: Layout, work: Workload) -> int:
    """The attention output's all-to-all payload ``b s H d a`` (part of :func:`cp_bytes`' second)."""
    return L.micro_batch * (work.seq_len // L.cp) * model.n_heads // L.tp * model.head_dim * work.act_bytes


def cp_collectives(add: Adder, model: ModelConfig, L: Layout, work: Workload, n_layers: int, m: int,
                   rerun: int) -> None:
    """The cp traffic of ``n_layers`` layers for ``m`` micro-batches (``rerun``: forward passes
    recomputation repeats), in the comm counter's (op, axis) keys: see the module docstring."""
    if L.cp == 1:
        return
    u, r = L.cp_split()
    u_axis, r_axis = axis_names(L)
    block, a2a, hops = cp_bytes(model, L, work)
    a = work.act_bytes
    for op in ("send", "recv"):
        add(op, r_axis, r, n_layers * hops * block * a, m + rerun)  # K/V forward (and rerun)
        add(op, r_axis, r, n_layers * hops * (block * a + block * 4), m)  # K/V and fp32 dK/dV backward
    # selective recomputation stops once the core's saved tensors are back: the output's
    # all-to-all (it saves nothing) is not rerun; full recomputation needs its result (o_proj's input)
    out = _out_bytes(model, L, work)
    add("all_to_all", u_axis, u, n_layers * a2a, 2 * m)
    add("all_to_all", u_axis, u, n_layers * (a2a - out if L.recompute == "selective" else a2a), rerun)


def cp_times(model: ModelConfig, L: Layout, work: Workload, cluster: Cluster) -> tuple[float, float]:
    """Seconds per layer and micro-batch of (one ring pass of K/V over the ring, which attention
    compute can hide; the forward's Ulysses all-to-alls, on the critical path; backward has the
    same two). Ring hops run over ``r`` ranks spaced ``tp * u`` apart, all-to-alls over ``u``
    ranks spaced ``tp``."""
    if L.cp == 1:
        return 0.0, 0.0
    u, r = L.cp_split()
    block, a2a, hops = cp_bytes(model, L, work)
    ring = 0.0
    if hops:
        bw, lat, _ = cluster.axis_bandwidth(r, L.tp * u)
        ring = hops * (block * work.act_bytes / bw + lat)
    out = _out_bytes(model, L, work)
    moved = (u - 1) / u if u > 1 else 0.0
    a2a_s = all_to_all_time(cluster, (a2a - out) * moved, u, L.tp) + all_to_all_time(cluster, out * moved, u, L.tp)
    return ring, a2a_s
