"""PipeDream-2BW (``parallel.pipeline_schedule = "2bw"``, :mod:`hybridpar.parallel.pipeline.twobw`).

The schedule: its steps are cuts of one continuous 1F1B stream (the stream is a valid schedule:
every micro-batch's F and B once per rank, deadlock-free), each step's messages stay inside it,
at most two weight versions (batches) are live on a rank, and the simulator times a steady step.

The runtime against a single-process implementation of the 2BW update rule,
V_{s+2} = opt_s(V_{s+1}, grad f_s(V_s)): the ordinary single-process trainer whose gradient is
computed at the version the batch runs on, then applied to the newest weights. Tolerances as in
tests/test_layouts.py (losses 1e-5 relative; weights an absolute 1% of lr x steps, since Adam
turns gradient rounding noise into up to lr per step). A checkpoint resumes bit for bit.
"""

from __future__ import annotations

from collections import Counter
from itertools import product

import layouts
import pytest
import torch
from layouts import SMALL, Run, assert_trains_like, reference, train, train_layout
from numerics import layout_weight_atol

from hybridpar.config import ConfigError, load_config
from hybridpar.parallel.pipeline import (
    ActionKind,
    Costs,
    build_schedule,
    check_schedule,
    max_in_flight,
    simulate,
)
from hybridpar.parallel.pipeline.schedules import build_two_bw_step, two_bw_stream
from hybridpar.training import checkpoint
from hybridpar.training.trainer import Trainer

LR = 3e-3
STEPS = 4  # the delay shows from step 2 on (batch 2 still runs on the initial weights)
WEIGHT_ATOL = layout_weight_atol(LR, STEPS)
MODEL = ("--model.n_layers", "4")
TWO_BW = ["--parallel.pipeline_schedule", "2bw", "--train.steps", str(STEPS)]
LAYOUTS = {  # (model flags, layout flags): the reference is the single process with the model flags
    "pp2": ([], ["--parallel.pp", "2"]),
    "pp4": ([], ["--parallel.pp", "4"]),
    "dp2-pp2": ([], ["--parallel.dp", "2", "--parallel.pp", "2"]),
    "pp2-tp2-sp": ([], ["--parallel.pp", "2", "--parallel.tp", "2", "--parallel.sequence_parallel", "true"]),
    "pp2-tied": (["--model.tie_embeddings", "true"], ["--parallel.pp", "2"]),
    "pp2-cp2": ([], ["--parallel.pp", "2", "--parallel.cp", "2"]),
}
CASES = [(2, 2), (2, 4), (3, 3), (3, 5), (4, 4), (4, 8)]  # (pp, micro-batches per step)


def two_bw_run(tmp: str, flags: list[str] | tuple[str, ...], **kw) -> Run:
    """The 2BW run of ``flags`` (model and layout) in ``tmp``; ``kw``: checkpoints, probes."""
    return Run(tmp, (*MODEL, *flags, *TWO_BW), STEPS, lr=LR, **kw)


# ----------------------------------------------------------------------------- the schedule


@pytest.mark.parametrize("pp, m", CASES)
def test_stream_of_steps_is_a_valid_schedule(pp, m):
    """Four steps back to back (the first with its warm-up, the last draining) form a schedule of
    4M micro-batches that passes every structural check (each micro-batch's F and B exactly once
    per rank, in order; sends and receives matching) and the simulator's deadlock check, and holds
    1F1B's activations: pp - r on rank r (the warm-up forwards a step carries over included)."""
    stream = two_bw_stream(pp, m, steps=4)
    check_schedule(stream)
    simulate(stream)
    for r in range(pp):
        assert max_in_flight(stream.ranks[r]) == stream.promised_in_flight(r) == min(pp - r, m)


@pytest.mark.parametrize("pp, m", CASES)
def test_each_step_is_self_contained(pp, m):
    """Every step (first/steady/last/single) runs alone: each receive's message is sent within
    it (the simulator would deadlock otherwise), sends and receives match pairwise in order, each
    rank runs every backward of its batch once and the forwards of its batch that the previous
    step did not run, plus the next batch's warm-up when the step has a tail."""
    for head, tail in product((True, False), repeat=2):
        sched = build_two_bw_step(pp, m, head, tail)
        simulate(sched)
        sent: dict[tuple[int, int], list] = {}
        received: dict[tuple[int, int], list] = {}
        for r, acts in enumerate(sched.ranks):
            warmup = pp - 1 - r
            backward = sorted(a.microbatch for a in acts if a.kind is ActionKind.B)
            forward = sorted(a.microbatch for a in acts if a.kind is ActionKind.F)
            assert backward == list(range(m))
            assert forward == list(range(0 if head else warmup, m)) + (list(range(m, m + warmup)) if tail else [])
            for a in acts:
                msg = a.message()
                if a.kind.is_send:
                    sent.setdefault((r, sched.rank_of(msg.dst)), []).append(msg)
                elif a.kind.is_recv:
                    received.setdefault((sched.rank_of(msg.src), r), []).append(msg)
        assert sent == received
    assert build_two_bw_step(pp, m, True, False).ranks == build_schedule("1f1b", pp, 1, m).ranks  # a lone step


@pytest.mark.parametrize("pp, m", CASES)
def test_at_most_two_weight_versions(pp, m):
    """Along each rank's stream, the stored activations belong to at most two batches at once
    (the version in use and the newest), and when a batch's last backward has run (the cut, where
    its version's storage is rewritten) none of its activations is left."""
    stream = two_bw_stream(pp, m, steps=4)
    for acts in stream.ranks:
        live: Counter[int] = Counter()
        for a in acts:
            batch = a.microbatch // m
            if a.kind is ActionKind.F:
                live[batch] += 1
            elif a.kind is ActionKind.B:
                live[batch] -= 1
                if a.microbatch % m == m - 1:
                    assert live[batch] == 0
            live = +live
            assert len(live) <= 2


@pytest.mark.parametrize("pp, m", CASES)
def test_simulated_steady_step(pp, m):
    """On equal stages (F, and B the whole backward): a steady step whose stages start together, as
    the runtime's (each step ends with collectives over pp), takes M (F + B) + (pp - 1) B, only
    the cut's backward chain idle, where 1F1B takes (M + pp - 1)(F + B). Without those step
    barriers the stream's steady state has a bubble of one B per step: the activation held over
    to the next step leaves after the rank's last backward, one B later than 1F1B sends it."""
    f, b = 1.0, 2.0  # full backward = b + w
    costs = Costs(f=f, b=b / 2, w=b / 2)
    steady = simulate(build_two_bw_step(pp, m, head=False, tail=True), costs).makespan
    assert steady == m * (f + b) + (pp - 1) * b
    assert simulate(build_schedule("1f1b", pp, 1, m), costs).makespan == (m + pp - 1) * (f + b)
    spans = [simulate(two_bw_stream(pp, m, k), costs).makespan for k in (2, 3, 4)]
    assert spans[2] - spans[1] == spans[1] - spans[0] == m * (f + b) + b


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("flags, match", [
    (["--parallel.zero_stage", "1"], r"'2bw' with parallel.zero_stage = 1 is not supported: ZeRO-1/2"),
    (["--parallel.dp", "2", "--parallel.zero_stage", "2"], r"zero_stage = 2 is not supported.*zero_stage = 0"),
    (["--parallel.zero_stage", "3"], r"parallel.zero_stage = 3 with parallel.pp = 2|zero_stage = 3 is not supported"),
    (["--parallel.pp", "1"], r"'2bw' needs parallel.pp >= 2 \(got 1\)"),
    (["--parallel.pp", "4", "--train.global_batch", "4"], r"at least parallel.pp = 4 micro-batches.* = 2; raise "
                                                           r"global_batch to 8"),
    (["--parallel.virtual_stages", "2"], r"virtual_stages = 2 needs parallel.pipeline_schedule = 'interleaved'"),
    (["--parallel.recompute", "full"], r"recompute = 'full' is not supported: recomputation"),
    (["--train.precision", "fp16"], r"precision = 'fp16' is not supported.*use bf16 or fp32"),
    (["--model.family", "mixtral", "--model.n_experts", "4"], r"n_experts = 4, parallel.ep = 1 is not supported"),
])
def test_refusals_are_config_errors_before_any_process_group(flags, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [*SMALL, "--model.n_layers", "8", "--parallel.pp", "2", "--parallel.pipeline_schedule", "2bw", *flags])
    assert not torch.distributed.is_initialized()


# ----------------------------------------------------------------------------- the runtime


def _at_stale(trainer: Trainer) -> dict:
    """Make ``trainer`` follow the 2BW rule in one process: each step's gradient computed at the
    previous version V_s, then applied to the newest weights."""
    params, engine = trainer.params, trainer.engine
    stale = [p.detach().clone() for p in params]  # V_1 = V_2 = W_0
    forward_backward = engine.forward_backward

    def at_stale(batches, grad_scale=None, upcoming=None):  # noqa: ANN001, ANN202
        nonlocal stale
        newest = [p.detach().clone() for p in params]  # V_{s+1}
        with torch.no_grad():
            for p, v in zip(params, stale, strict=True):
                p.copy_(v)
        losses = forward_backward(batches, grad_scale)  # g_s = grad f_s(V_s)
        with torch.no_grad():
            for p, v in zip(params, newest, strict=True):
                p.copy_(v)  # the step then makes V_{s+2} = opt_s(V_{s+1}, g_s)
        stale = newest
        return losses

    engine.forward_backward = at_stale
    return {}


def rule(tmp: str, model_flags: tuple[str, ...], delayed: bool = True) -> layouts.Trained:
    """One process: the 2BW rule (``delayed``), or ordinary synchronous training."""
    flags = (*MODEL, *model_flags, "--train.steps", str(STEPS))
    return reference(Run(tmp, flags, STEPS, lr=LR, before=_at_stale if delayed else None))


@pytest.mark.numerics
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_runtime_equals_the_single_process_rule(name, tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "twobw")
    model, layout = LAYOUTS[name]
    ref = rule(tmp, tuple(model))
    sync = rule(tmp, tuple(model), delayed=False)
    # the rule is not synchronous training: batch 1 runs on W_0 in both, batch 2 on W_0 only in 2BW
    assert ref.losses[0] == sync.losses[0] and abs(ref.losses[1] - sync.losses[1]) > 1e-3
    assert_trains_like(train_layout(two_bw_run(tmp, [*model, *layout])), ref, atol=WEIGHT_ATOL)


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["pp2-tp2-sp", "dp2-pp2"])
def test_checkpoint_resumes_bit_for_bit(name, tmp_path):
    """Saved after step 2 (both weight versions; the next batch's warm-up forwards already ran
    and are replayed on resume), continued to step 4: the same losses and weights, exactly."""
    model, layout = LAYOUTS[name]
    flags = [*model, *layout]
    whole = train_layout(two_bw_run(str(tmp_path), flags, save_at=2))
    resumed = train_layout(two_bw_run(str(tmp_path), flags, resume_from=2))
    assert resumed[0].losses == whole[0].losses[2:]
    assert resumed[0].state.keys() == whole[0].state.keys()
    for k, v in whole[0].state.items():
        assert torch.equal(resumed[0].state[k], v), k


def _fit(rank: int, world: int, tmp: str) -> dict:
    flags = ["--parallel.pp", "2", *TWO_BW, "--train.eval_every", "2", "--train.sample_tokens", "4"]
    with layouts.trainer_for(layouts.make_config(tmp, *MODEL, *flags, lr=LR)) as trainer:
        return trainer.fit()


def test_a_whole_run(dist_run, tmp_path):
    """``fit`` end to end: validation, the last step's recorded timeline (its ranks ran different
    numbers of actions: the last step drains), the checkpoint, the report."""
    summary = dist_run(2, _fit, str(tmp_path))[0]
    assert summary["steps"] == STEPS and summary["val_loss"] == summary["val_loss"]
    assert (tmp_path / "pipeline_timeline.png").is_file() and checkpoint.latest_checkpoint(tmp_path) is not None


@pytest.mark.numerics
def test_checkpoint_reshards_to_another_layout(tmp_path, tmp_path_factory):
    """Saved after step 2 under pp2 x tp2 + SP (the second version as tp pieces), continued under
    pp4: the single-process rule's losses and weights, to the tolerances above."""
    ref = rule(str(tmp_path_factory.getbasetemp() / "twobw"), ())
    saved, loaded = LAYOUTS["pp2-tp2-sp"][1], LAYOUTS["pp4"][1]
    train_layout(two_bw_run(str(tmp_path), saved, save_at=2))
    resumed = train_layout(two_bw_run(str(tmp_path), loaded, resume_from=2))
    assert resumed[0].start == 2
    assert_trains_like(resumed, ref, atol=WEIGHT_ATOL)

def _sync_then_2bw(rank: int, world: int, tmp: str) -> tuple[list[float], list[float]]:
    one_f_one_b = layouts.make_config(tmp, *MODEL, "--parallel.pp", "2", "--train.steps", str(STEPS), lr=LR)
    with layouts.trainer_for(one_f_one_b) as trainer:
        sync = []
        for s in range(1, STEPS + 1):
            sync.append(trainer.train_step(s).loss)
            if s == 2:
                trainer.save_checkpoint(s)
    with layouts.trainer_for(layouts.make_config(tmp, *MODEL, "--parallel.pp", "2", *TWO_BW, lr=LR)) as trainer:
        trainer.load_checkpoint(checkpoint.step_dir(trainer.run_dir, 2))
        return sync, [trainer.train_step(s).loss for s in range(3, STEPS + 1)]


@pytest.mark.numerics
def test_a_synchronous_checkpoint_continues_as_2bw(dist_run, tmp_path):
    """A 1F1B checkpoint holds one weight version: 2BW continues from it as from initial weights
    (V_3 = V_4 = the loaded W_2), so step 3 is 1F1B's step 3 and step 4's batch runs on W_2 too."""
    sync, two_bw = dist_run(2, _sync_then_2bw, str(tmp_path))[0]
    assert two_bw[0] == pytest.approx(sync[2], rel=1e-6)
    assert abs(two_bw[1] - sync[3]) > 1e-3


def test_planner_counts_the_second_weight_version():
    """The planner's memory model holds one more copy of each stage's parameters for 2BW than for
    1F1B (the runtime keeps two storages per parameter), and the same activations."""
    from hybridpar.config import ModelConfig
    from hybridpar.planner.memory.plan import rank_memory
    from hybridpar.planner.model.layout import Layout, Workload

    work = Workload(global_batch=16, seq_len=128, precision="fp32")
    for rank in (0, 1):
        one, two = (rank_memory(ModelConfig(), Layout(dp=1, tp=1, pp=2, cp=1, pipeline_schedule=s), work, rank)
                    for s in ("1f1b", "2bw"))
        assert two.components["params"] == 2 * one.components["params"]
        assert two.components["activations"] == one.components["activations"]


def _save_with_a_slow_copy(rank: int, world: int, tmp: str, flags: list[str]) -> None:
    """Train with a save after step 2 whose background copy takes longer than a step."""
    import time

    from hybridpar.training.checkpoint import HostStager

    real = HostStager.stage

    def slow(self, state):  # noqa: ANN001, ANN202
        time.sleep(1.0)  # step 3 runs meanwhile: its pipeline step rewrites the older weight version
        return real(self, state)

    HostStager.stage = slow
    try:
        train(rank, world, two_bw_run(tmp, flags, save_at=2))
    finally:
        HostStager.stage = real


@pytest.mark.numerics
def test_an_async_checkpoint_holds_the_second_weight_version_of_its_step(dist_run, tmp_path):
    """``async_checkpoint.enabled``: the copy of a save runs beside the next step, whose pipeline
    rewrites the older weight version at its end; the step waits for the copy before its
    backward, so the checkpoint holds its own step's two versions, tensor for tensor the
    synchronous save's."""
    from test_async_checkpoint import saved_tensors

    model, layout = LAYOUTS["dp2-pp2"]
    flags = [*model, *layout]
    sync_run = two_bw_run(str(tmp_path / "sync"), flags, save_at=2)
    train_layout(sync_run)
    dist_run(sync_run.world_size, _save_with_a_slow_copy, str(tmp_path / "async"),
             [*flags, "--async_checkpoint.enabled", "true"])
    sync, _ = saved_tensors(checkpoint.step_dir(sync_run.config().train.run_dir, 2))
    done, _ = saved_tensors(checkpoint.step_dir(two_bw_run(str(tmp_path / "async"), flags).config().train.run_dir, 2))
    assert any("weight_versions" in k for k in sync) and set(done) == set(sync)
    for k, v in sync.items():  # not the RNG states: the pooled workers' generators carry earlier tests' draws
        assert k.startswith("rng.") or torch.equal(done[k], v), k
