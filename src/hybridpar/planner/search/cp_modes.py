"""Context parallelism's mode chosen for a layout: every legal mode (ring, Ulysses, the hybrid at
each degree) timed by the cost model's layer time (:func:`hybridpar.planner.price.cost.layer_time`,
whose cp terms :mod:`hybridpar.planner.price.cp` prices), the fastest kept."""

from __future__ import annotations

import dataclasses

from hybridpar.config import ModelConfig
from hybridpar.planner.machine.hardware import Cluster
from hybridpar.planner.model.layout import Layout, Workload
from hybridpar.planner.price.cost import priced_layer
from hybridpar.rules import ulysses_error


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
    t = priced_layer(model, L, work, cluster)
    return t.f + t.b + t.w


def choose_cp_mode(model: ModelConfig, L: Layout, work: Workload, cluster: Cluster) -> Layout:
    """``L`` with the fastest cp mode (:func:`modes`, timed by :func:`layer_seconds`; ring on a
    tie, then the smaller Ulysses degree); ``L`` itself when cp = 1."""
    if L.cp == 1:
        return L
    return min(modes(model, L), key=lambda c: (layer_seconds(model, c, work, cluster), c.cp_split()[0]))


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
