"""``hybridpar plan --dry-run [K]`` (:mod:`hybridpar.training.dryrun_plan`): the plan's ranked
layouts dry-run in order until K have built, so a layout that cannot build is never ranked first.

The tiny preset on 8 ranks: the top two layouts build, and their dry-run ranks' traffic and
FLOPs equal the planner's. A layout the trainer refuses but the planner's search prices: a small
DeepSeek-V3 with multi-token prediction (``runtime-mtp-layout``: MTP runs under data, expert
and ZeRO parallelism only; the search skips ``runtime-*`` rules) on a cluster whose links take
1 ms per collective step. There the planner's fastest is dp4 x pp2: the plan sets it aside
(``unbuilt``) and ranks dp8 first, and its dry run is refused with the rule's message.
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


def test_a_layout_the_trainer_refuses_is_never_first_and_its_dry_run_says_why(tmp_path, capsys):
    """The planner's fastest layout here is dp4 x pp2, MTP under pp, which train refuses: the plan
    sets it aside as ``unbuilt`` and ranks dp8 first, and dry-running the refused layout itself
    drops it with the rule's one-line message."""
    model = make_config(str(tmp_path), *DS_MTP).model
    (tmp_path / "config.json").write_text(json.dumps(family_of(model).hf.to_hf_config(model)))
    (tmp_path / "slow.toml").write_text('[gpu]\nbase = "H100-SXM"\nintra_latency = 1e-3\n')
    argv = ["--model", str(tmp_path), "--gpu", str(tmp_path / "slow.toml"), "--gpus", "8", "--global-batch", "8",
            "--seq-len", "64", "--top", "3", "--json"]
    plain = _plan(capsys, argv)
    assert (plain["unbuilt"]["dp"], plain["unbuilt"]["pp"]) == (4, 2)  # the fastest: MTP under pp
    doc = _plan(capsys, [*argv, "--dry-run", "1"])
    assert doc["dry_run"] == {"dropped": []} and doc["layouts"][0]["dp"] == 8 and doc["layouts"][0]["dry_run"]["ranks"]
    work = Workload(8, 64, "bf16")
    fastest = search(model, work, Cluster.of(dataclasses.replace(gpu_spec("H100-SXM"), intra_latency=1e-3), 8, 8),
                     top=3, runnable_top=True).unbuilt
    assert fastest is not None and (fastest.layout.dp, fastest.layout.pp) == (4, 2)
    refused = check_layout(model, work, fastest).refused
    assert refused is not None and refused.startswith("the trainer refuses it: model.mtp_layers = 1")
    assert "\n" not in refused


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
