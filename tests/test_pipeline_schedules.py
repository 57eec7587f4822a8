"""Pipeline schedules as pure data: structure, deadlock freedom, memory promise, bubbles.

No process group: the schedules, the simulator and the partitioner are plain functions.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpar.cli import main
from hybridpar.config import ModelConfig
from hybridpar.parallel.pipeline import (
    Action,
    ActionKind,
    Balance,
    Costs,
    DeadlockError,
    Schedule,
    ScheduleError,
    build_schedule,
    check_schedule,
    max_in_flight,
    partition_layers,
    partition_model,
    schedule_warnings,
    simulate,
    textbook_bubble,
)
from hybridpar.parallel.pipeline.partition import layer_params
from hybridpar.parallel.pipeline.schedules import build_forward_schedule, needed_message


@st.composite
def layouts(draw, kinds=tuple(Schedule)):
    """(kind, pp, V, M) covering every schedule; interleaved gets M divisible by pp."""
    kind = draw(st.sampled_from(kinds))
    pp = draw(st.integers(1, 8))
    if kind is Schedule.INTERLEAVED:
        v = draw(st.integers(1, 4)) if pp > 1 else 1
        m = pp * draw(st.integers(1, 4))
    elif kind is Schedule.ZBV:
        v, m = 2, draw(st.integers(1, 20))
    else:
        v, m = 1, draw(st.integers(1, 20))
    return kind, pp, v, m


costs = st.builds(Costs, f=st.floats(0.1, 5), b=st.floats(0.1, 5), w=st.floats(0.0, 5),
                  p2p=st.floats(0.0, 1))


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_structure(layout):
    """Each (micro-batch, chunk) has one F, one B (and one W iff split) in order F < B < W on
    its own rank; receives precede consumers, sends follow producers, and sends and receives
    between each pair of ranks match one to one in the same (FIFO) order."""
    sched = build_schedule(*layout)
    check_schedule(sched)
    kind, pp, v, m = layout
    per_rank = (3 if sched.split_backward else 2) * m * v
    assert [len(sched.compute_actions(r)) for r in range(pp)] == [per_rank] * pp


@settings(max_examples=150, deadline=None)
@given(layouts(), costs)
def test_deadlock_free_and_dependencies_hold(layout, c):
    """Simulating the send/recv matching completes under any costs, and the resulting times
    respect every data dependency across stages."""
    sched = build_schedule(*layout)
    timeline = simulate(sched, c)
    when = {(iv.action.kind, iv.action.microbatch, iv.action.stage): iv
            for row in timeline.ranks for iv in row}
    eps = 1e-9
    def hop(a: ActionKind, mb: int, s: int) -> float:  # a hand-over between stages of one rank is free
        return 0.0 if sched.is_local(needed_message(Action(a, mb, s), sched.num_stages)) else c.p2p

    for (kind, mb, s), iv in when.items():
        if kind is ActionKind.F and s > 0:
            assert iv.start >= when[(ActionKind.F, mb, s - 1)].end + hop(kind, mb, s) - eps
        if kind is ActionKind.B:
            assert iv.start >= when[(ActionKind.F, mb, s)].end - eps
            if s < sched.num_stages - 1:
                assert iv.start >= when[(ActionKind.B, mb, s + 1)].end + hop(kind, mb, s) - eps
        if kind is ActionKind.W:
            assert iv.start >= when[(ActionKind.B, mb, s)].end - eps
    for row in timeline.ranks:  # one action at a time per rank
        assert all(a.end <= b.start + eps for a, b in zip(row, row[1:], strict=False))


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_in_flight_equals_promise(layout):
    """Peak stored activations per rank equal the promise: GPipe M, 1F1B pp - rank, interleaved
    per Megatron's warm-up formula, ZB-H1 min(pp, M), ZBV min(2pp, 2M, M + 1 + rank) chunks."""
    sched = build_schedule(*layout)
    kind, pp, v, m = layout
    got = [max_in_flight(sched.ranks[r]) for r in range(pp)]
    assert got == [sched.promised_in_flight(r) for r in range(pp)]
    if kind is Schedule.GPIPE:
        assert got == [m] * pp
    if kind is Schedule.ONE_F_ONE_B:
        assert got == [min(pp - r, m) for r in range(pp)]
    if kind is Schedule.ZBV:
        assert got == [min(2 * pp, 2 * m, m + 1 + r) for r in range(pp)]


@settings(max_examples=150, deadline=None)
@given(layouts(), st.floats(0.2, 4), st.floats(0.2, 4))
def test_unit_cost_bubbles_match_textbook(layout, t_f, t_b):
    """Equal stage costs, free p2p: GPipe and 1F1B idle (pp-1)/(M+pp-1) of the time whatever the
    F:B ratio; interleaved (pp-1)/(V*M+pp-1), i.e. 1/V of the bubble time; ZB-H1 with
    F = B = W idles (pp-1)(F+B-W) per rank instead of (pp-1)(F+B+W); ZBV half of ZB-H1's."""
    sched = build_schedule(*layout)
    if sched.split_backward:
        t_b = 2 * t_f  # the ZB-H1 formula is stated for F = B = W (full backward 2F)
    c = Costs(t_f, t_b / 2, t_b / 2).per_chunk(sched.virtual_stages)
    timeline = simulate(sched, c)
    assert timeline.bubble_fraction == pytest.approx(textbook_bubble(sched), abs=1e-9)
    busy = sched.microbatches * (t_f + t_b)
    bubble_time = timeline.makespan - busy
    p, v, m = sched.pp, sched.virtual_stages, sched.microbatches
    if not sched.split_backward:
        assert bubble_time == pytest.approx((p - 1) * (t_f + t_b) / v, abs=1e-9)
    elif sched.kind is Schedule.ZB_H1 and m >= p:
        assert bubble_time == pytest.approx((p - 1) * t_f, abs=1e-9)
    elif sched.kind is Schedule.ZBV and m >= 2 * p - 1:
        assert bubble_time == pytest.approx((p - 1) * t_f / 2, abs=1e-9)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3), st.integers(1, 12), st.booleans())
def test_forward_only_schedule(pp, v, m, v_shape):
    """Evaluation lists (also in ZBV's V placement): F and activation transfers only, any M,
    deadlock-free, no stalls once M >= pp."""
    v = 2 if v_shape else 1 if pp == 1 else v
    sched = build_forward_schedule(pp, v, m, v_shape)
    check_schedule(sched)
    assert all(a.kind in (ActionKind.F, ActionKind.SEND_ACT, ActionKind.RECV_ACT)
               for acts in sched.ranks for a in acts)
    if m >= pp and not v_shape:
        assert simulate(sched, Costs(1, 0, 0)).makespan == pytest.approx(v * m + pp - 1)
    else:
        simulate(sched)


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16), (8, 8)])
def test_zero_bubble_halves_1f1b_bubble(pp, m):
    one = simulate(build_schedule("1f1b", pp, 1, m), Costs(1, 1, 1))
    zb = simulate(build_schedule("zb-h1", pp, 1, m), Costs(1, 1, 1))
    assert zb.makespan - 3 * m <= 0.5 * (one.makespan - 3 * m)
    assert zb.bubble_fraction < 0.5 * one.bubble_fraction
    zbv = simulate(build_schedule("zbv", pp, 2, m), Costs(1, 1, 1).per_chunk(2))
    assert zbv.makespan <= zb.makespan
    if m >= 2 * pp - 1:  # ZBV's steady state: half of ZB-H1's bubble
        assert zbv.makespan - 3 * m <= 0.5 * (zb.makespan - 3 * m)


def test_zbv_places_chunks_as_a_v():
    """Rank r holds stages r and 2pp - 1 - r; the turn (pp - 1 -> pp) is handed over locally, so
    only 2pp - 2 boundaries have sends; the partition places chunks the same way."""
    pp = 4
    sched = build_schedule("zbv", pp, 2, 8)
    assert [sched.stages_of(r) for r in range(pp)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert sched.is_local(Action(ActionKind.SEND_ACT, 0, 3).message())
    sends = [a for acts in sched.ranks for a in acts if a.kind is ActionKind.SEND_ACT]
    assert len(sends) == 8 * (2 * pp - 2)
    part = partition_layers(16, pp, 2, v_shape=True)
    assert [[c.stage for c in part.for_rank(r)] for r in range(pp)] == [sched.stages_of(r) for r in range(pp)]


def test_known_lists():
    """1F1B on two ranks, spelled out (sends after producers, receives prefetched)."""
    sched = build_schedule("1f1b", 2, 1, 3)
    def names(rank: int) -> list[str]:
        return [f"{a.kind.value}{a.microbatch}" for a in sched.ranks[rank]]

    assert names(0) == ["F0", "send_act0", "recv_grad0", "F1", "send_act1", "B0", "recv_grad1", "F2",
                        "send_act2", "recv_grad2", "B1", "B2"]
    assert names(1) == ["recv_act0", "F0", "recv_act1", "B0", "send_grad0", "F1", "recv_act2", "B1",
                        "send_grad1", "F2", "B2", "send_grad2"]


def test_deadlock_is_reported():
    """A rank that waits for a gradient before sending the activation it depends on."""
    sched = build_schedule("gpipe", 2, 1, 2)
    f1, send1 = Action(ActionKind.F, 1, 0), Action(ActionKind.SEND_ACT, 1, 0)
    bad = [a for a in sched.ranks[0] if a not in (f1, send1)]
    first_b = next(i for i, a in enumerate(bad) if a.kind is ActionKind.B)
    bad[first_b + 1:first_b + 1] = [f1, send1]  # F1 after B0, but B0 needs rank 1 past F1
    bad_sched = dataclasses.replace(sched, ranks=(tuple(bad), sched.ranks[1]))
    with pytest.raises(DeadlockError, match=r"rank 0 at B\(mb=0, stage=0\)"):
        simulate(bad_sched)


def test_check_catches_fifo_mismatch():
    sched = build_schedule("1f1b", 2, 1, 4)
    r1 = list(sched.ranks[1])
    recv1 = Action(ActionKind.RECV_ACT, 1, 1)
    r1.remove(recv1)
    r1.insert(0, recv1)  # still before its consumer, but ahead of mb 0's message from the same peer
    with pytest.raises(ScheduleError, match="differ"):
        check_schedule(dataclasses.replace(sched, ranks=(sched.ranks[0], tuple(r1))))


@pytest.mark.parametrize("args, needle", [
    (("interleaved", 4, 2, 6), "divisible by parallel.pp: 6 % 4 = 2; use 4 or 8 micro-batches"),
    (("interleaved", 4, 2, 2), "divisible by parallel.pp: 2 % 4 = 2; use 4 micro-batches"),
    (("1f1b", 4, 2, 8), "virtual_stages = 2 needs parallel.pipeline_schedule = 'interleaved' "),
    (("interleaved", 1, 2, 4), "needs parallel.pp >= 2"),
    (("zbv", 2, 1, 4), r"'zbv' needs parallel.virtual_stages = 2 \(two chunks per rank placed as a V\), got 1"),
    (("gpipe", 2, 1, 0), "microbatches >= 1"),
    (("pipedream", 2, 1, 4), "unknown pipeline schedule"),
])
def test_bad_arguments(args, needle):
    with pytest.raises(ScheduleError, match=needle):
        build_schedule(*args)


def test_warning_for_few_microbatches():
    assert "bubble-dominated" in schedule_warnings(Schedule.ONE_F_ONE_B, 4, 1, 2)[0]
    assert schedule_warnings(Schedule.ONE_F_ONE_B, 4, 1, 4) == []


# ----------------------------------------------------------------------------- partition


def test_partition_by_layers_and_layout():
    part = partition_layers(10, 2, 2)
    assert [len(c.layers) for c in part.chunks] == [3, 3, 2, 2]
    assert [(c.rank, c.chunk) for c in part.chunks] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert part.chunks[0].embedding and part.chunks[-1].head
    assert [c.stage for c in part.for_rank(1)] == [1, 3]
    text = part.describe()
    assert "embedding + layers 0-2" in text and "layers 8-9 + norm + head" in text


def test_partition_by_params_moves_layers_off_heavy_ends():
    cfg = ModelConfig(dim=64, n_layers=8, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=4096)
    part = partition_model(cfg, 4, balance=Balance.PARAMS)
    sizes = [len(c.layers) for c in part.chunks]
    assert sizes == [1, 3, 3, 1]  # embedding and head weigh ~7 layers each; the middle stays even
    by_count_max = cfg.vocab_size * cfg.dim + cfg.dim + 2 * layer_params(cfg)  # head stage of 2/2/2/2
    assert max(c.weight for c in part.chunks) < by_count_max


def test_partition_by_cost_is_optimal():
    costs = [1, 1, 1, 1, 8, 1, 1, 1]
    part = partition_layers(8, 2, 1, Balance.COST, costs, 0.0, 0.0)
    assert max(c.weight for c in part.chunks) == 11  # best split of [1,1,1,1,8,1,1,1] in two
    assert sum(len(c.layers) for c in part.chunks) == 8


@pytest.mark.parametrize("seed", range(40))
def test_min_max_split_equals_exhaustive_search(seed):
    """Against every way to cut the layers: the largest stage is the least possible, and of the
    splits that reach it, ours is the evenest (least sum of squares). Integer weights: exact."""
    import itertools
    import random

    from hybridpar.parallel.pipeline.partition import _min_max_split

    rng = random.Random(seed)
    n = rng.randint(1, 9)
    k = rng.randint(1, n)
    weights = [float(rng.randint(1, 9)) for _ in range(n)]
    first, last = float(rng.choice([0, 3, 12])), float(rng.choice([0, 5, 20]))

    def sums(sizes):
        bounds = [0, *itertools.accumulate(sizes)]
        return [sum(weights[bounds[g]:bounds[g + 1]]) + (first if g == 0 else 0) + (last if g == k - 1 else 0)
                for g in range(k)]

    every = [[b - a for a, b in zip((0, *cuts), (*cuts, n), strict=True)]
             for cuts in itertools.combinations(range(1, n), k - 1)]
    best = min((max(sums(c)), sum(x * x for x in sums(c))) for c in every)
    got = _min_max_split(weights, k, first, last)
    assert len(got) == k and min(got) >= 1 and sum(got) == n
    assert (max(sums(got)), sum(x * x for x in sums(got))) == best


def test_default_partition_balances_matmul_flops():
    """The runtime's default: a head worth ~3.6 layers of FLOPs and MoE layers (2 of 8 experts
    active) that cost more than dense ones move layers to the light stages; equal layer counts
    would leave the head stage the slowest."""
    cfg = ModelConfig(dim=64, n_layers=12, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=2048)
    layer, head = cfg.layer_flops(0, seq_len=0), cfg.head_flops()
    assert 3 < head / layer < 4
    part = partition_model(cfg, 4)
    assert part.balance is Balance.FLOPS
    sizes = [len(c.layers) for c in part.chunks]
    assert sizes[-1] == 1 and sum(sizes) == 12  # the head stage: one layer + head (4.6 layers' worth)
    assert max(c.weight for c in part.chunks) == layer + head < 3 * layer + head  # 3 + head: the even split's
    moe = ModelConfig(dim=64, n_layers=8, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=256, family="mixtral",
                      n_experts=8, experts_per_token=2, moe_ffn_hidden=128, moe_layers="0,1,2,3")
    sizes = [len(c.layers) for c in partition_model(moe, 2).chunks]
    assert sizes[0] < sizes[1]  # the MoE half is heavier per layer
    # a hand-set split wins over any balance
    assert [len(c.layers) for c in partition_model(cfg, 4, layer_counts=[3, 3, 3, 3]).chunks] == [3, 3, 3, 3]


def test_partition_needs_a_layer_per_chunk():
    with pytest.raises(ScheduleError, match=r"model.n_layers = 4 < parallel.pp \* virtual_stages = 4 \* 2 = 8"):
        partition_layers(4, 4, 2)


# ----------------------------------------------------------------------------- timeline command


def test_timeline_command(tmp_path, capsys):
    out = tmp_path / "t.png"
    assert main(["timeline", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bubble fraction: 0.2727" in capsys.readouterr().out
    assert main(["timeline", "--schedule", "interleaved", "--virtual-stages", "2", "--out", str(out)]) == 0
    assert "bubble fraction: 0.1579" in capsys.readouterr().out
    assert main(["timeline", "--schedule", "interleaved", "--microbatches", "6", "--out", str(out)]) == 2
    assert "divisible by parallel.pp" in capsys.readouterr().err
