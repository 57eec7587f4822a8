"""What a pipeline rank holds at its peaks: how many micro-batches of each of its chunks are alive
(between their forward and backward) and held (ZB-H1: between B and W), from the schedule's own
compute order. :mod:`hybridpar.planner.memory.plan` weights these counts by each chunk's bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from hybridpar.parallel.pipeline.schedules import ActionKind, Schedule, compute_order, rank_stages


@functools.lru_cache(maxsize=4096)
def peak_microbatches(kind: str, pp: int, microbatches: int) -> int:
    """The micro-batch count :func:`live_chunk_counts` depends on: the walked schedules' peaks
    repeat past ``2 pp`` micro-batches (ZB-H1) or ``4 pp`` (interleaved), so longer runs share
    one answer (and one cache entry; the 70B search asked for ~1,800 distinct counts)."""
    kind_ = Schedule.parse(kind)
    if pp == 1 or kind_ in (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.TWO_BW):
        return microbatches
    return min(microbatches, (4 if kind_ is Schedule.INTERLEAVED else 2) * pp)


def live_chunk_counts(kind: str, pp: int, virtual_stages: int, microbatches: int,
                      rank: int) -> tuple[tuple[int, ...], ...]:
    """:func:`_live_chunk_counts` of the :func:`peak_microbatches` that decide it."""
    return _live_chunk_counts(kind, pp, virtual_stages, peak_microbatches(kind, pp, microbatches), rank)


@functools.lru_cache(maxsize=8192)
def _live_chunk_counts(kind: str, pp: int, virtual_stages: int, microbatches: int,
                       rank: int) -> tuple[tuple[int, ...], ...]:
    """What rank ``rank`` of a ``pp``-stage pipeline holds at its peaks: the Pareto-maximal
    vectors ``(alive_0, .., alive_{V-1}, held_0, .., held_{V-1})`` over the schedule's compute
    order, where ``alive_c`` counts micro-batches of local chunk ``c`` between their F and their
    first backward action, and ``held_c`` those between B and W (ZB-H1: deferred weight gradients).

    GPipe, 1F1B and 2BW have closed forms (``M`` and ``min(pp - rank, M)``); the others walk
    :func:`compute_order`, capped at ``2 pp`` micro-batches (ZB-H1) or ``4 pp`` (interleaved):
    past the warm-up the steady state repeats every micro-batch (every ``pp`` with
    interleaving), so the peaks of longer runs are the same."""
    kind_ = Schedule.parse(kind)
    m, v = microbatches, virtual_stages
    if pp == 1:
        return ((1, 0),)
    if kind_ is Schedule.GPIPE:
        return ((m, 0),)
    if kind_ in (Schedule.ONE_F_ONE_B, Schedule.TWO_BW):  # 2BW: a step's carried warm-up forwards included
        return ((min(pp - rank, m), 0),)
    cap = min(m, (4 if kind_ is Schedule.INTERLEAVED else 2) * pp)
    actions = compute_order(kind_, pp, v, cap, rank)
    split = any(a.kind is ActionKind.W for a in actions)
    local = rank_stages(rank, pp, v, kind_ is Schedule.ZBV)
    counts = [0] * (2 * v)
    seen: set[tuple[int, ...]] = set()
    for act in actions:
        c = local.index(act.stage)
        if act.kind is ActionKind.F:
            counts[c] += 1
        elif act.kind is ActionKind.B:
            counts[c] -= 1
            if not split:
                continue
            counts[v + c] += 1
        else:
            counts[v + c] -= 1
            continue
        seen.add(tuple(counts))  # peaks follow an increase
    return pareto_max(seen)


def pareto_max(vectors: Iterable[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The vectors no other one covers componentwise (a covering vector has a larger sum, so
    in decreasing-sum order the kept ones are all a vector needs to be checked against)."""
    kept: list[tuple[int, ...]] = []
    for x in sorted(set(vectors), key=lambda x: (-sum(x), x)):
        if not any(all(k >= xi for k, xi in zip(y, x, strict=True)) for y in kept):
            kept.append(x)
    return tuple(sorted(kept))
