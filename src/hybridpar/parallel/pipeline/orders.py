"""Each schedule's compute order: the F, B and W actions of one pipeline rank, in the order it
runs them, before :mod:`.schedules` adds the sends and receives. Pure functions of
``(pp, [virtual stages,] micro-batches, rank)``; the rules they assume are checked by
:func:`~.schedules.check_schedule_args`.
"""

from __future__ import annotations

from hybridpar.parallel.pipeline.actions import Action, ActionKind


def _f(m: int, s: int) -> Action:
    """Forward of micro-batch ``m`` on stage ``s``."""
    return Action(ActionKind.F, m, s)


def _b(m: int, s: int) -> Action:
    """Backward of micro-batch ``m`` on stage ``s``."""
    return Action(ActionKind.B, m, s)


def gpipe_order(pp: int, m: int, rank: int) -> list[Action]:
    """All forwards, then all backwards (micro-batch order, as torch's ScheduleGPipe)."""
    return [_f(i, rank) for i in range(m)] + [_b(i, rank) for i in range(m)]


def one_f_one_b_order(pp: int, m: int, rank: int) -> list[Action]:
    """``pp - 1 - rank`` warm-up forwards, then alternate F and B, then the remaining Bs."""
    warmup = min(pp - 1 - rank, m)
    out = [_f(i, rank) for i in range(warmup)]
    for i in range(m - warmup):
        out += [_f(warmup + i, rank), _b(i, rank)]
    return out + [_b(i, rank) for i in range(m - warmup, m)]


def interleaved_order(pp: int, v: int, m: int, rank: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B (needs ``m % pp == 0``). The k-th forward of a rank runs
    micro-batch ``(k // (pp*v))*pp + k % pp`` on local chunk ``(k % (pp*v)) // pp``; backwards
    use the same micro-batch order on chunks in reverse. Warm-up is
    ``2*(pp - rank - 1) + (v - 1)*pp`` forwards (all of them when m == pp)."""
    total = m * v

    def mb(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    def chunk(k: int, forward: bool) -> int:
        c = (k % (pp * v)) // pp
        return c if forward else v - 1 - c

    def fwd(k: int) -> Action:
        return _f(mb(k), chunk(k, True) * pp + rank)

    def bwd(k: int) -> Action:
        return _b(mb(k), chunk(k, False) * pp + rank)

    warmup = total if m == pp else min(total, 2 * (pp - rank - 1) + (v - 1) * pp)
    out = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [fwd(warmup + k), bwd(k)]
    return out + [bwd(k) for k in range(total - warmup, total)]


def zb_h1_order(pp: int, m: int, rank: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2023, as torch's ZB1P at one stage per rank): 1F1B with B split into
    an input-gradient B and a weight-gradient W; rank r runs each W r backwards after its B, so
    downstream Bs (the critical path) go first and the deferred Ws fill the cool-down bubble."""
    warmup = min(pp - 1 - rank, m)
    out = [_f(i, rank) for i in range(warmup)]
    backwards = 0
    weights = 0

    def backward() -> None:
        nonlocal backwards, weights
        out.append(_b(backwards, rank))
        if backwards >= rank:
            out.append(Action(ActionKind.W, weights, rank))
            weights += 1
        backwards += 1

    for i in range(m - warmup):
        out.append(_f(warmup + i, rank))
        backward()
    while backwards < m:
        backward()
    out += [Action(ActionKind.W, i, rank) for i in range(weights, m)]
    return out


def zbv_order(pp: int, m: int, rank: int) -> list[Action]:
    """ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6; the order torch's
    ScheduleZBVZeroBubble also uses): rank r runs chunk 0 = stage r and chunk 1 = stage
    2pp - 1 - r. Warm-up: ``2(pp - r) - 1`` forwards of chunk 0, then ``r`` pairs (chunk 1,
    chunk 0), then ``pp - r`` rounds of chunk 1's F, B, W; steady state: F, B, W of chunk 0 then
    of chunk 1; cool-down: the remaining Bs with the Ws deferred into the drain. The order is
    built for ``max(M, 2pp - 1)`` micro-batches and the ones past M are dropped."""
    n = max(2 * pp - 1, m)
    c0, c1 = rank, 2 * pp - 1 - rank
    out: list[Action] = []
    f0 = f1 = b0 = b1 = 0

    def w(mb: int, stage: int) -> Action:
        return Action(ActionKind.W, mb, stage)

    for _ in range(2 * (pp - rank) - 1):
        out.append(_f(f0, c0))
        f0 += 1
    for _ in range(rank):
        out += [_f(f1, c1), _f(f0, c0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(pp - rank):
        out += [_f(f1, c1), _b(b1, c1), w(b1, c1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            out.append(_f(f0, c0))
            f0 += 1
        out += [_b(b0, c0), w(b0, c0), _f(f1, c1), _b(b1, c1), w(b1, c1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):
        out += [_b(b0, c0), _b(b1, c1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(pp - rank):
        out += [_b(b0, c0), w(w0, c0)]
        b0, w0 = b0 + 1, w0 + 1
    out += [w(i, c1) for i in range(w1, b1)] + [w(i, c0) for i in range(w0, b0)]
    return [a for a in out if a.microbatch < m]


def two_bw_order(pp: int, m: int, rank: int, head: bool = True, tail: bool = False) -> list[Action]:
    """One PipeDream-2BW step of rank ``rank``: a cut of one continuous 1F1B stream. ``head``:
    the step runs this batch's ``pp - 1 - rank`` warm-up forwards itself (the first step after
    a start or a resume; otherwise the previous step ran them). Then 1F1B pairs: the forward of
    each pair runs this batch's remaining micro-batches, then, with ``tail``, the next batch's
    first ``pp - 1 - rank`` (numbered ``m + i``); the backward runs this batch's in order.
    Without ``tail`` (the last step) the Bs left over drain the pipeline as in 1F1B, so
    ``head and not tail`` is exactly 1F1B."""
    warmup = min(pp - 1 - rank, m)
    out = [_f(i, rank) for i in range(warmup)] if head else []
    forwards = list(range(warmup, m)) + (list(range(m, m + warmup)) if tail else [])
    for i, mb in enumerate(forwards):
        out += [_f(mb, rank), _b(i, rank)]
    return out + [_b(i, rank) for i in range(len(forwards), m)]
