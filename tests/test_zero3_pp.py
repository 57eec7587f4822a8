"""ZeRO-3 under pipeline parallelism (:class:`hybridpar.parallel.zero.zero3_pp.StageSharded`).

The comm counter shows each chunk's parameters gathered once per step and its gradients
reduce-scattered once (not twice per micro-batch: these runs have M = 4 micro-batches per
rank), and the model states the runtime holds at their peak (sampled at every gather and
release) equal the planner's ZeRO-3 x pp formula for every pipeline rank. Equality with one
process for every schedule is in the invariance matrix (``tests/test_layouts.py``); here also a
tied embedding, whose two copies' gradients are summed over pp, with evaluation and sampling.
"""

from __future__ import annotations

import pytest
import torch
from layouts import make_config, trainer_for
from test_layouts import MODEL, STEPS, WEIGHT_ATOL

from hybridpar.planner.memory.plan import rank_memory
from hybridpar.planner.model.layout import from_config

pytestmark = pytest.mark.numerics

BASE = ["--parallel.dp", "2", "--parallel.pp", "2", "--parallel.zero_stage", "3", "--train.global_batch", "16"]
SCHEDULES = {
    "1f1b": [],
    "interleaved": ["--parallel.pipeline_schedule", "interleaved", "--parallel.virtual_stages", "2"],
    "zb-h1": ["--parallel.pipeline_schedule", "zb-h1"],
    "zbv": ["--parallel.pipeline_schedule", "zbv", "--parallel.virtual_stages", "2"],
}


def _count_worker(rank: int, world: int, tmp: str, layout: list[str]) -> dict:
    cfg = make_config(tmp, *MODEL, *layout)
    with trainer_for(cfg) as trainer:
        topo = trainer.topo
        trainer.train_step(1)  # warm-up: the optimizer state exists
        opt = trainer.engine.optimizer
        sharded = opt.sharded
        samples: list[tuple[str, int, int]] = []
        gather, release = sharded.before_first, sharded.after_last

        def sample(where: str) -> None:
            m = opt.memory_bytes()
            samples.append((where, m["params"], m["grads"]))

        def spy_gather(chunk: torch.nn.Module) -> None:
            gather(chunk)
            sample("gathered")

        def spy_release(chunk: torch.nn.Module, backward: bool) -> None:
            sample("release")  # before the chunk's units are resharded
            release(chunk, backward)

        sharded.before_first, sharded.after_last = spy_gather, spy_release
        counter = topo.comm.counter
        counter.reset()
        trainer.train_step(2)
        return {"pp_rank": topo.pp.rank, "units": len(sharded.units), "chunks": len(trainer.engine.chunks),
                "gathers": counter.calls("all_gather", "dp"), "reduces": counter.calls("reduce_scatter", "dp"),
                "samples": samples}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_each_chunk_gathered_once_per_step_and_states_match_planner(schedule, dist_run, tmp_path):
    layout = [*BASE, *SCHEDULES[schedule]]
    cfg = make_config(str(tmp_path), *MODEL, *layout)
    plan_layout, work = from_config(cfg)
    assert plan_layout.microbatches(work.global_batch) == 4
    v = cfg.parallel.virtual_stages
    for r in dist_run(cfg.parallel.world_size, _count_worker, str(tmp_path), layout):
        assert r["units"] == r["chunks"] == v
        assert r["gathers"] == v and r["reduces"] == v  # per step, whatever the micro-batch count
        mem = rank_memory(cfg.model, plan_layout, work, r["pp_rank"]).components
        peak = max(p + g for _, p, g in r["samples"])
        first_release = next((p, g) for where, p, g in r["samples"] if where == "release")
        # the peak of parameters + gradients is right before the first release: every chunk
        # gathered, every gradient accumulated unsharded, nothing reduced yet
        assert first_release == (mem["params"], mem["grads"]), f"pp rank {r['pp_rank']}"
        assert peak == mem["params"] + mem["grads"], f"pp rank {r['pp_rank']}"


TIED = ["--model.tie_embeddings", "true"]


def _tied_worker(rank: int, world: int, tmp: str, layout: list[str]) -> dict:
    cfg = make_config(tmp, *MODEL, *layout, "--train.sample_tokens", "8")
    with trainer_for(cfg) as trainer:
        losses = [trainer.train_step(s).loss for s in range(1, STEPS + 1)]
        evaluated = trainer.evaluate()
        text = trainer.sample_text()
        state = trainer.engine.full_state_dict()
        return {"losses": losses, "eval": evaluated, "text": text, "state": state if rank == 0 else None}


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_tied_embedding_with_evaluation_and_sampling(schedule, dist_run, tmp_path):
    """1F1B: the embedding and its mirror sit on pp ranks 0 and 1, their gradients summed after
    the pipeline (the units holding them stay gathered until then); ZBV: both ends on rank 0,
    one unit read by two chunks. Same losses, evaluation and weights as one process."""
    ref = _tied_worker(0, 1, str(tmp_path / "one"), TIED)
    layout = [*BASE, "--train.global_batch", "8", *SCHEDULES[schedule], *TIED]
    results = dist_run(4, _tied_worker, str(tmp_path), layout)
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert r["eval"] == pytest.approx(ref["eval"], rel=1e-5)
        assert r["text"] == results[0]["text"]
    assert "output.weight" not in results[0]["state"]
    for k, v in results[0]["state"].items():
        torch.testing.assert_close(v, ref["state"][k], rtol=0, atol=WEIGHT_ATOL, msg=lambda m, k=k: f"{k}: {m}")
