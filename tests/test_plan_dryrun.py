"""``hybridpar plan --dry-run [K]`` (:mod:`hybridpar.training.dryrun_plan`): the plan's ranked
layouts dry-run in order until K have built, so a layout that cannot build is never ranked first.

The tiny preset on 8 ranks: the top two layouts build, and their dry-run ranks' traffic and
FLOPs equal the planner's. A small DeepSeek-V3 with multi-token prediction on a cluster whose
links take 1 ms per collective step: there the planner's fastest is dp4 x pp2, MTP under pp,
whose dry run equals the planner too.
"""

from __future__ import annotations

import dataclasses
import json

from layouts import make_config
from test_deepseek_v3_layouts import DS, MTP

from hybridpar.cli import main
from hybridpar.config import model_preset
from hybridpar.models.registry import family_of
from hybridpar.planner.machine.hardware import Cluster, gpu_spec
from hybridpar.planner.model.layout import Workload
from hybridpar.planner.search.search import search
from hybridpar.training.dryrun_plan import check_layout

DS_MTP = (*DS, *MTP)  # tests/test_deepseek_v3_layouts.py's small DeepSeek-V3, one multi-token prediction module
TINY = ["--model", "tiny", "--gpus", "8", "--global-batch", "16", "--seq-len", "128", "--json"]


def _plan(capsys, argv: list[str]) -> dict:
    capsys.readouterr()
    assert main(["plan", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_top_layouts_dry_run_beside_the_planner(capsys):
    plain = _plan(capsys, [*TINY, "--top", "2"])
    doc = _plan(capsys, [*TINY, "--top", "2", "--dry-run", "2"])
    assert doc["dry_run"] == {"dropped": []}
    assert [{k: v for k, v in lay.items() if k != "dry_run"} for lay in doc["layouts"]] == plain["layouts"]
    for lay in doc["layouts"]:
        ranks = lay["dry_run"]["ranks"]
        assert ranks and ranks[0]["rank"] == 0 and (lay["pp"] == 1 or len(ranks) == 2)
        for r in ranks:
            assert r["traffic"] and set(r["traffic_diff"].values()) == {0}, (lay, r["rank"])
            assert r["flops"] > 0 and r["flops"] == r["flops_planned"]
            assert r["peak_bytes"] > 0 and r["peak_error"] == r["peak_bytes"] / r["peak_planned_bytes"] - 1


def test_mtp_under_pp_dry_runs_beside_the_planner(tmp_path, capsys):
    """The planner's fastest layout here is dp4 x pp2, multi-token prediction under pp (the
    modules on the last stage with a mirror of the embedding): the plan ranks it first, and its
    dry run's ranks' traffic (the mirror's gradient exchange included) and FLOPs equal the
    planner's."""
    model = make_config(str(tmp_path), *DS_MTP).model
    (tmp_path / "config.json").write_text(json.dumps(family_of(model).hf.to_hf_config(model)))
    (tmp_path / "slow.toml").write_text('[gpu]\nbase = "H100-SXM"\nintra_latency = 1e-3\n')
    argv = ["--model", str(tmp_path), "--gpu", str(tmp_path / "slow.toml"), "--gpus", "8", "--global-batch", "8",
            "--seq-len", "64", "--top", "3", "--json"]
    doc = _plan(capsys, [*argv, "--dry-run", "1"])
    assert doc["dry_run"] == {"dropped": []} and doc.get("unbuilt") is None
    first = doc["layouts"][0]
    assert (first["dp"], first["pp"]) == (4, 2)
    ranks = first["dry_run"]["ranks"]
    assert len(ranks) == 2
    for r in ranks:
        assert r["traffic"] and set(r["traffic_diff"].values()) == {0}, r["rank"]
        assert r["flops"] > 0 and r["flops"] == r["flops_planned"]


def test_a_layout_whose_measured_peak_does_not_fit_is_dropped(tmp_path):
    """The device check itself: with the usable memory set to the rank's measured live tensors,
    the planner's allocator overhead on top does not fit, and the layout is dropped saying so."""
    model, work = model_preset("tiny"), Workload(16, 128, "bf16")
    best = search(model, work, Cluster.of(gpu_spec("H100-SXM"), 8, 8), top=1, runnable_top=True).ranked[0]
    built = check_layout(model, work, best)
    assert built.refused is None
    peak = max(int(r["peak_bytes"]) for r in built.ranks)
    small = check_layout(model, work, dataclasses.replace(best, capacity=float(peak)))
    assert small.refused is not None and small.refused.startswith("does not fit: rank")
    assert "allocator overhead" in small.refused and small.ranks
