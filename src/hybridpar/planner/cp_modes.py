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
:func:`hybridpar.planner.cost.layer_time` and keeps the fastest (ring on a tie).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hybridpar.config import ModelConfig
from hybridpar.planner.hardware import Cluster
from hybridpar.planner.layout import Layout, Workload
from hybridpar.rules import ulysses_error

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
    from hybridpar.planner.cost import all_to_all_time  # cost prices layers with these

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


def modes(model: ModelConfig, L: Layout) -> list[Layout]:
    """Every cp mode legal for ``L``'s axes: ring, hybrid at each Ulysses degree between 1 and
    cp that divides it, and Ulysses (degree cp), where rule ``cp-ulysses-heads`` allows."""
    out = [dataclasses.replace(L, cp_mode="ring", cp_ulysses=0)]
    if L.cp == 1:
        return out
    for u in range(2, L.cp + 1):
        if L.cp % u or ulysses_error(model, L.tp, u, "hybrid") is not None:
            continue
        out.append(dataclasses.replace(L, cp_mode="ulysses", cp_ulysses=0) if u == L.cp
                   else dataclasses.replace(L, cp_mode="hybrid", cp_ulysses=u))
    return out


def layer_seconds(model: ModelConfig, L: Layout, work: Workload, cluster: Cluster) -> float:
    """Forward + backward seconds of one dense layer and micro-batch under ``L`` (cost's model)."""
    from hybridpar.planner.cost import layer_time

    t = layer_time(model, L, work, cluster)
    return t.f + t.b + t.w


def choose_cp_mode(model: ModelConfig, L: Layout, work: Workload, cluster: Cluster) -> Layout:
    """``L`` with the fastest cp mode (:func:`modes`, timed by :func:`layer_seconds`; ring on a
    tie, then the smaller Ulysses degree); ``L`` itself when cp = 1."""
    if L.cp == 1:
        return L
    return min(modes(model, L), key=lambda c: (layer_seconds(model, c, work, cluster), c.cp_split()[0]))


def cp_reason(model: ModelConfig, L: Layout, work: Workload, cluster: Cluster) -> list[str]:
    """One line for ``hybridpar plan``: the chosen mode, its traffic and layer time against the
    other legal modes'."""
    if L.cp == 1:
        return ["cp_mode: none needed, cp = 1 (the fastest layout splits no sequence over ranks)"]
    parts = []
    for c in modes(model, L):
        block, a2a, hops = cp_bytes(model, c, work)
        traffic = 2 * a2a + hops * block * (3 * work.act_bytes + 4)  # sent per layer, forward + backward
        parts.append(f"{describe(c)} {traffic / 2**20:,.0f} MiB {1e3 * layer_seconds(model, c, work, cluster):.2f} ms")
    return [f"cp_mode {describe(L)}: per layer and micro-batch, cp payload and layer time: " + "; ".join(parts)]


def describe(L: Layout) -> str:
    """``ring``, ``ulysses``, ``hybrid (ulysses 8 x ring 4)``."""
    u, r = L.cp_split()
    return f"hybrid (ulysses {u} x ring {r})" if L.cp_mode == "hybrid" else L.cp_mode


def cp_fields(model: ModelConfig, axes: dict[str, object], partial: dict[str, object], work: Workload,
              cluster: Cluster) -> dict[str, object]:
    """The ``cp_mode`` / ``cp_ulysses`` fields of a search candidate with ``axes`` (and its
    micro-batch): those ``partial`` fixes, else :func:`choose_cp_mode`'s; none at cp = 1."""
    if "cp_mode" in partial:
        return {"cp_mode": partial["cp_mode"], "cp_ulysses": partial.get("cp_ulysses", 0)}
    if axes.get("cp", 1) == 1:
        return {}
    best = choose_cp_mode(model, Layout(**axes), work, cluster)  # type: ignore[arg-type]
    return {"cp_mode": best.cp_mode, "cp_ulysses": best.cp_ulysses}
