"""The pipeline runtime on gloo: one step at pp in {2, 4} with every schedule equals the
single-process model on the same micro-batches (losses and every gradient, fp32, rtol 1e-5,
atol 1e-7), and the measured peak of stored activations equals the schedule's promise.

Tiny Llama: dim 32, 4 layers (8 when pp * V = 8 chunks need them), micro-batches of 2 x 8 tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_pipeline_wsplit import deferred_bytes

from hybridpar.config import ModelConfig
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.models.llama import Llama, LlamaChunk
from hybridpar.parallel.pipeline import ActionKind, ScheduleError, build_schedule
from hybridpar.parallel.pipeline.runtime import PipelineRunner, fused_backward
from hybridpar.parallel.pipeline.stages import (
    build_stage_modules,
    owned_named_parameters,
    sync_tied_embedding_grads,
)

pytestmark = pytest.mark.numerics  # layout equality: also run under other ATEN_CPU_CAPABILITY (Makefile)

MB, SEQ, DIM = 2, 8, 32


def _cfg(n_layers: int, tie: bool) -> ModelConfig:
    return ModelConfig(dim=DIM, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                       vocab_size=64, max_seq_len=SEQ, tie_embeddings=tie)


def _batches(m: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (m, MB, SEQ + 1), generator=gen)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _model(n_layers: int, tie: bool) -> Llama:
    model = Llama(_cfg(n_layers, tie))
    model.init_weights(3)
    return model


def _pipeline_step(rank: int, world: int, kind: str, v: int, m: int, n_layers: int, tie: bool) -> dict:
    model = _model(n_layers, tie)
    with ParallelDims(pp=world).build() as topo:
        sched = build_schedule(kind, world, v, m)
        chunks = build_stage_modules(model, LlamaChunk, topo.pp.rank, world, v, v_shape=sched.v_shape)
        runner = PipelineRunner(chunks, topo, sched, _loss, act_shape=(MB, SEQ, DIM))
        batches = _batches(m, model.cfg.vocab_size)
        eval_losses = runner.evaluate(batches[:3])  # forward only, any micro-batch count
        before = topo.comm.counter.bytes("send", "pp")
        result = runner.run(batches)
        p2p_bytes = topo.comm.counter.bytes("send", "pp") - before
        sync_tied_embedding_grads(chunks, topo)
        timeline = runner.gather_timeline(result)
        grads = {name: p.grad.clone() for c in chunks for name, p in c.named_parameters()}
        owned = [name for name, _ in owned_named_parameters(chunks)]
        return {"losses": result.losses, "eval_losses": eval_losses, "owned": owned, "grads": grads, "peak": result.peak_activations,
                "deferred_bytes": result.peak_deferred_bytes,
                "promise": sched.promised_in_flight(topo.pp.rank), "p2p_bytes": p2p_bytes,
                "timeline_rows": [len(row) for row in timeline.ranks],
                "order": [iv.action for iv in result.intervals],
                "computes": [a for a in sched.ranks[topo.pp.rank] if a.kind.is_compute]}


def _reference(m: int, n_layers: int, tie: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = _model(n_layers, tie)
    losses = []
    for x, y in _batches(m, model.cfg.vocab_size):
        loss = _loss(model(x), y)
        (loss / m).backward()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.grad for n, p in model.named_parameters()}


CASES = [(world, kind, 2 if kind in ("interleaved", "zbv") else 1)
         for world in (2, 4) for kind in ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")]


@pytest.mark.parametrize("world, kind, v", CASES, ids=[f"pp{w}-{k}" for w, k, _ in CASES])
def test_pipeline_step_matches_single_process(dist_run, world, kind, v):
    m = 2 * world
    n_layers = max(4, world * v)
    results = dist_run(world, _pipeline_step, kind, v, m, n_layers, False)
    ref_losses, ref_grads = _reference(m, n_layers, False)
    for r in results:  # every pp rank gets the per-micro-batch losses of the last stage
        torch.testing.assert_close(r["losses"], ref_losses, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(r["eval_losses"], ref_losses[:3], rtol=1e-5, atol=1e-7)
    grads: dict[str, torch.Tensor] = {}
    for r in results:
        assert not set(grads) & set(r["grads"]), "a parameter lives on two pipeline ranks"
        grads.update(r["grads"])
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert [r["peak"] for r in results] == [r["promise"] for r in results]
    # ZB-H1 and ZBV keep from B to W only the deferred linears' inputs and output gradients (formula
    # in test_pipeline_wsplit); the other schedules keep nothing past B, nor does a rank whose every
    # B is followed at once by its W with nothing to send (ZB-H1's first stage: one full backward)
    cfg, per_chunk = _cfg(n_layers, False), n_layers // (world * v)
    sched = build_schedule(kind, world, v, m)
    assert [r["deferred_bytes"] for r in results] == [
        deferred_bytes(cfg, per_chunk, rank == world - 1 if kind == "zb-h1" else rank == 0, MB * SEQ)
        if kind in ("zb-h1", "zbv") and len(fused_backward(sched, rank)) < m * v else 0 for rank in range(world)]
    if kind in ("zb-h1", "zbv"):
        assert fused_backward(sched, 0) == {(mb, 0) for mb in range(m)}
    # The runtime ran the schedule's compute actions in order, and every p2p byte was counted:
    # each of the S-1 boundaries moves one activation and one gradient per micro-batch.
    assert all(r["order"] == r["computes"] for r in results)
    # (ZBV's turn from stage pp - 1 to pp stays on one rank: one boundary fewer on the wire.)
    act_bytes = MB * SEQ * DIM * 4
    boundaries = world * v - 1 - (kind == "zbv")
    assert sum(r["p2p_bytes"] for r in results) == 2 * m * boundaries * act_bytes
    per_rank = (3 if kind in ("zb-h1", "zbv") else 2) * m * v
    assert results[0]["timeline_rows"] == [per_rank] * world


@pytest.mark.parametrize("world, kind", [(2, "1f1b"), (4, "zb-h1"), (2, "zbv")])
def test_tied_embeddings_across_first_and_last_stage(dist_run, world, kind):
    """The head on the last rank uses its own copy of the embedding weight; after
    sync_tied_embedding_grads both copies hold the single-process gradient. (ZBV puts the first
    and the last stage on rank 0: one weight, used by two chunks.)"""
    m, n_layers = world, 4
    results = dist_run(world, _pipeline_step, kind, 2 if kind == "zbv" else 1, m, n_layers, True)
    ref_losses, ref_grads = _reference(m, n_layers, True)
    torch.testing.assert_close(results[0]["losses"], ref_losses, rtol=1e-5, atol=1e-7)
    first, last = results[0]["grads"], results[0 if kind == "zbv" else -1]["grads"]
    torch.testing.assert_close(first["tok_embeddings.weight"], ref_grads["tok_embeddings.weight"],
                               rtol=1e-5, atol=1e-7)
    assert torch.equal(first["tok_embeddings.weight"], last["tok_embeddings.weight"])
    owned = [name for r in results for name in r["owned"]]  # the mirror is not counted twice
    assert sorted(owned) == sorted(ref_grads)
    for r in results:
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_few_microbatches_and_zb_weight_steps(dist_run):
    """M < pp still runs (warm-up capped at M) and ZB-H1 runs one W per (micro-batch, chunk)."""
    results = dist_run(4, _pipeline_step, "zb-h1", 1, 2, 4, False)
    ref_losses, _ = _reference(2, 4, False)
    torch.testing.assert_close(results[0]["losses"], ref_losses, rtol=1e-5, atol=1e-7)
    for r in results:
        assert sum(a.kind is ActionKind.W for a in r["order"]) == 2
        assert r["peak"] == r["promise"] == 2


def test_single_stage_runs_in_process():
    """pp = 1 (no process group): the runner is plain gradient accumulation."""
    m, n_layers = 3, 2
    model = _model(n_layers, True)
    topo = ParallelDims().build()
    chunks = build_stage_modules(model, LlamaChunk, 0, 1)
    runner = PipelineRunner(chunks, topo, build_schedule("1f1b", 1, 1, m), _loss, (MB, SEQ, DIM))
    result = runner.run(_batches(m, model.cfg.vocab_size))
    ref_losses, ref_grads = _reference(m, n_layers, True)
    torch.testing.assert_close(result.losses, ref_losses, rtol=1e-5, atol=1e-7)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert result.peak_activations == 1
    with pytest.raises(ScheduleError, match=r"schedule has 3 micro-batches, run\(\) got 2"):
        runner.run(_batches(2, model.cfg.vocab_size))


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"])
def test_uneven_layer_counts_match_single_process(dist_run, kind):
    """5 layers on pp = 2 (2 or 4 chunks): chunks of different sizes, every schedule, the same
    losses and gradients as one process."""
    v = 2 if kind in ("interleaved", "zbv") else 1
    results = dist_run(2, _pipeline_step, kind, v, 4, 5, False)
    ref_losses, ref_grads = _reference(4, 5, False)
    torch.testing.assert_close(results[0]["losses"], ref_losses, rtol=1e-5, atol=1e-7)
    grads = {name: g for r in results for name, g in r["grads"].items()}
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)
