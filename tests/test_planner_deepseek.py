"""The planner on DeepSeek-V3-shaped models: it never ranks first a layout ``hybridpar train``
refuses (the ``runtime-*`` rules become runtime notes, and ``plan`` sets those layouts aside;
shown with a stand-in rule refusing multi-token prediction under cp, which the runtime now trains), and the search's memo of a layer's price
returns what pricing the layer afresh returns, for layouts that differ in the fields the memo
ignores."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from hybridpar.config import model_preset
from hybridpar.planner.machine.hardware import Cluster, gpu_spec
from hybridpar.planner.model import layout as layout_mod
from hybridpar.planner.model.layout import Layout, Workload, runtime_note, to_config
from hybridpar.planner.price.cost import layer_time, priced_layer
from hybridpar.planner.search.search import search
from hybridpar.rules import base as rules_base
from hybridpar.rules import first_broken


def _small_deepseek():  # DeepSeek-V3's layer shapes, 8 layers, 64 experts: plannable on one node
    return dataclasses.replace(model_preset("deepseek-v3"), n_layers=8, moe_layers="1,2,3,4,5,6,7", n_experts=64)


def _mtp_under_cp(cfg, world):  # the limit the runtime had before MTP ran under cp (issue 43)
    if cfg.model.mtp_layers and cfg.parallel.cp > 1:
        return f"model.mtp_layers = {cfg.model.mtp_layers} with parallel.cp = {cfg.parallel.cp}: refused here"
    return None


@pytest.fixture
def runtime_limit(monkeypatch):
    """A ``runtime-*`` rule refusing MTP under cp, for this test only (the runtime has no such
    limit left): the planner's notes are cached per layout, so the caches are emptied around it."""
    monkeypatch.setattr(rules_base, "RULES", [*rules_base.RULES, rules_base.Rule("runtime-test-mtp-cp", _mtp_under_cp)])
    layout_mod._broken.cache_clear()
    layout_mod._runtime_broken.cache_clear()
    yield
    monkeypatch.undo()
    layout_mod._broken.cache_clear()
    layout_mod._runtime_broken.cache_clear()


def test_plan_never_ranks_first_a_layout_train_refuses(runtime_limit):
    """8 H800s, 8 sequences of 32K: the fastest layout the cost model finds is context parallel
    with the MTP module, which a ``runtime-*`` rule here refuses. The plan's search
    (``runnable_top``) ranks first a layout ``train`` accepts and keeps the refused one as the
    unbuilt one, with the rule's message as its note."""
    model, work, world = _small_deepseek(), Workload(8, 32768), 8
    cluster = Cluster.of(gpu_spec("H800"), world)
    fastest = search(model, work, cluster, top=1).ranked[0]
    refused = first_broken(to_config(model, fastest.layout, work), world)
    assert refused is not None and refused.rule.name == "runtime-test-mtp-cp"
    assert fastest.note == refused.message == runtime_note(model, fastest.layout, work)
    planned = search(model, work, cluster, top=3, runnable_top=True)
    for ev in planned.ranked:
        assert ev.note is None and first_broken(to_config(model, ev.layout, work), world) is None
    assert planned.unbuilt is not None and planned.unbuilt.layout == fastest.layout
    assert planned.unbuilt.cost.step_time_s == fastest.cost.step_time_s < planned.ranked[0].cost.step_time_s


def test_mtp_under_cp_is_planned_first_without_the_limit():
    """Without that limit (the runtime's own rules), the same fastest layout, MTP under cp, is
    the plan's first, with no note."""
    model, work, world = _small_deepseek(), Workload(8, 32768), 8
    planned = search(model, work, Cluster.of(gpu_spec("H800"), world), top=1, runnable_top=True)
    first = planned.ranked[0]
    assert first.layout.cp > 1 and first.note is None
    assert first_broken(to_config(model, first.layout, work), world) is None


def test_layer_price_memo_equals_pricing_afresh():
    """``priced_layer`` keys a layer's price on the layout without the fields ``layer_time``
    does not read (ZeRO stage, hybrid sharding, optimizer offload, compression, and the
    schedule unless activations are offloaded): for layouts differing only in those, each
    memoised price equals ``layer_time`` of that very layout."""
    model, work = _small_deepseek(), Workload(64, 4096)
    cluster = Cluster.of(gpu_spec("H800"), 16)
    base = Layout(dp=4, tp=2, pp=2, cp=1, ep=4, micro_batch=2, sequence_parallel=True)
    variants = [dataclasses.replace(base, zero_stage=z, pipeline_schedule=s, virtual_stages=v, recompute=r,
                                    offload_activations=o, dp_shard=d, grad_compression=g)
                for z, (s, v), r, o, d, g in itertools.product(
                    (0, 1, 3), (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)), ("none", "full"), (False, True),
                    (0, 2), ("none", "int8"))]
    for lay in variants:
        for moe in (False, True):
            assert priced_layer(model, lay, work, cluster, moe) == layer_time(model, lay, work, cluster, moe=moe)
