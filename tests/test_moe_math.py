"""The MoE layer's math (:mod:`hybridpar.models.moe`) against direct references (issue 19):
the router (softmax and sigmoid scores, renormalised or not, top-k choice, a balancing bias that
chooses but never weights) and its losses against their formulas written out in float64; the
bias update rule exactly; ``compat.grouped_mm`` against its loop (forward and gradients, empty
experts included); and :class:`~hybridpar.models.moe.Experts` against transformers' own loop
over experts (``MixtralExperts``), forward and gradients.

Tolerances are rounding bounds: a float32 dot product of ``K`` terms is within
``K * eps * sum |terms|`` of the exact one (``gamma_K``, Higham 3.1), the functions after it move
that error by at most their Lipschitz constants (stated where used), and each test first checks
that no top-k choice is closer than its bound, so the same experts are chosen.
"""

from __future__ import annotations

import pytest
import torch

from hybridpar.compat import grouped_mm, grouped_mm_loop
from hybridpar.config import ModelConfig
from hybridpar.models.moe import AuxLossScale, Experts, MoE, Router, update_balance_bias
from hybridpar.parallel.experts import swiglu_experts

pytestmark = pytest.mark.numerics  # kernels compared with references

EPS32 = torch.finfo(torch.float32).eps
EPS64 = torch.finfo(torch.float64).eps
N, D, E = 64, 16, 8


def moe_config(**kw) -> ModelConfig:
    base = dict(dim=D, n_heads=2, n_kv_heads=2, n_layers=1, ffn_hidden=24, n_experts=E, experts_per_token=3,
                aux_loss_coef=0.0, z_loss_coef=0.0)
    return ModelConfig(**{**base, **kw})


def router_and_input(seed: int = 0, **kw) -> tuple[Router, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    router = Router(moe_config(**kw))
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, D, generator=gen) * 0.5)
        router.expert_bias.copy_(torch.randn(E, generator=gen) * 0.3)
    return router, torch.randn(N, D, generator=gen)


def logit_error(router: Router, x: torch.Tensor) -> float:
    """Bound on |float32 logits - exact|: gamma_D * max (|x| @ |W|^T) (one dot product of D terms)."""
    return 1.01 * D * EPS32 * (x.abs().double() @ router.weight.abs().double().T).max().item()


def reference_router(router: Router, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The router written out in float64: logits, scores, choice, weights (dense [N, E], 0 where
    not chosen)."""
    logits = x.double() @ router.weight.double().T
    scores = logits.softmax(-1) if router.score == "softmax" else logits.sigmoid()
    choose = scores + router.expert_bias.double() if router.use_bias else scores
    idx = choose.argsort(-1, descending=True)[:, :router.k]
    w = scores.gather(1, idx)
    if router.norm_topk:
        w = w / w.sum(-1, keepdim=True)
    ranked = choose.sort(-1, descending=True).values
    gap = (ranked[:, router.k - 1] - ranked[:, router.k]).min().item()
    return {"logits": logits, "scores": scores, "idx": idx, "dense": torch.zeros_like(scores).scatter(1, idx, w),
            "gap": gap, "picked": scores.gather(1, idx).sum(-1, keepdim=True)}


def dense(weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return torch.zeros(idx.shape[0], E, dtype=torch.float64).scatter(1, idx, weights.double())


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("norm", [True, False], ids=["renormalised", "raw"])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_router_matches_reference(score, norm, bias):
    # seed 1: no choice within rounding in any of the 8 cases (checked below)
    router, x = router_and_input(1, router_score=score, norm_topk_prob=norm, bias_update_rate=0.1 if bias else 0.0)
    weights, idx, aux = router(x)
    assert aux is None  # both coefficients 0
    ref = reference_router(router, x)
    # scores move by at most 2 x the largest logit error (softmax: |dp_e| <= p_e (|dl_e| + max |dl|);
    # sigmoid: 1/4 x), plus a few roundings of exp, sum and divide
    score_err = 2 * logit_error(router, x) + 8 * EPS32
    assert ref["gap"] > 4 * score_err, "test data: a top-k choice within rounding"
    assert torch.equal(idx.sort(-1).values, ref["idx"].sort(-1).values)
    # renormalised w_e = s_e / S (S the chosen scores' sum): |dw_e| <= (|ds_e| + k max |ds|) / S
    bound = (1 + router.k) * score_err / ref["picked"] if norm else torch.full((N, 1), score_err)
    assert bool(((dense(weights, idx) - ref["dense"]).abs() <= bound + 4 * EPS32).all())
    if bias:  # the bias changed some choices, yet every weight is the unbiased score's
        plain = router.use_bias
        router.use_bias = False
        assert not torch.equal(router(x)[1].sort(-1).values, idx.sort(-1).values)
        router.use_bias = plain


def reference_aux(ref: dict, router: Router, aux_coef: float, z_coef: float) -> torch.Tensor:
    """Load balancing ``aux_coef * E * sum_e f_e P_e`` (f: fraction of the N k slots on e; P: mean
    over tokens of the score of e, scores summed to 1 per token) plus ``z_coef * mean(lse^2)``."""
    f = torch.bincount(ref["idx"].reshape(-1), minlength=E).double() / (N * router.k)
    probs = ref["scores"] / ref["scores"].sum(-1, keepdim=True)
    return aux_coef * E * (f * probs.mean(0)).sum() + z_coef * torch.logsumexp(ref["logits"], -1).pow(2).mean()


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_auxiliary_losses_match_their_formulas(score):
    aux_coef, z_coef = 0.05, 0.01
    router, x = router_and_input(2, router_score=score, aux_loss_coef=aux_coef, z_loss_coef=z_coef)
    assert reference_router(router, x)["gap"] > 8 * logit_error(router, x) + 32 * EPS32
    _, idx, aux = router(x)
    ref = reference_router(router, x)
    assert torch.equal(idx.sort(-1).values, ref["idx"].sort(-1).values)
    expected = reference_aux(ref, router, aux_coef, z_coef)
    # every term is >= 0 (no cancellation): sums of N or E terms are within (N + E) eps of theirs;
    # the logits' error dl moves the probabilities by <= 2 dl (normalised sigmoid: 4 dl) and lse^2
    # by <= 2 |lse| dl + dl^2
    dl = logit_error(router, x)
    lse = torch.logsumexp(ref["logits"], -1).abs().max().item()
    tol = (N + E + 16) * EPS32 * expected.item() + aux_coef * E * 4 * dl + z_coef * (2 * lse * dl + dl * dl)
    assert abs(aux.item() - expected.item()) <= tol
    # split over two ranks: each counts over both halves' choices (sum_counts) and divides by the
    # token count of its share; the mean of the halves' losses (data parallel) is the whole's,
    # and with token_share 2 (sequence parallel: the halves make one share) their sum is
    halves = x[: N // 2], x[N // 2:]
    counts = [torch.bincount(router(h)[1].reshape(-1), minlength=E).float() for h in halves]
    for share, combine in ((1, lambda a, b: (a + b) / 2), (2, lambda a, b: a + b)):
        router.token_share = share
        parts = []
        for i, h in enumerate(halves):
            router.sum_counts = lambda c, other=counts[1 - i]: c + other
            parts.append(router(h)[2])
        assert abs(combine(*parts).item() - expected.item()) <= 2 * tol, share
    router.token_share, router.sum_counts = 1, lambda c: c


def test_auxiliary_loss_gradient_reaches_the_router_scaled():
    """The auxiliary loss enters backward through the layer's output with the engine's gradient
    scale: with the output's own gradient 0, the router's gradient is ``scale * d aux / d W``,
    the float64 formula's (bound: N-term sums of the logits' gradients times x, as above)."""
    aux_coef, z_coef, scale = 0.05, 0.01, 0.25
    cfg = moe_config(aux_loss_coef=aux_coef, z_loss_coef=z_coef, moe_ffn_hidden=12)
    aux_scale = AuxLossScale()
    aux_scale.grad_scale = scale
    moe = MoE(cfg, aux_scale)
    router, x = router_and_input(2, aux_loss_coef=aux_coef, z_loss_coef=z_coef)
    with torch.no_grad():
        moe.router.weight.copy_(router.weight)
        for w in (moe.experts.w1, moe.experts.w3, moe.experts.w2):
            w.normal_(0, 0.2, generator=torch.Generator().manual_seed(3))
    out = moe(x.view(4, N // 4, D))
    (0 * out.sum()).backward()
    w64 = router.weight.detach().double().requires_grad_()
    logits = (x.double() @ w64.T).requires_grad_()
    ref = reference_router(router, x)
    ref.update(logits=logits, scores=logits.softmax(-1))
    expected = reference_aux(ref, router, aux_coef, z_coef)
    (g_logits,) = torch.autograd.grad(scale * expected, logits, retain_graph=True)
    g_w = g_logits.T @ x.double()
    bound = 4 * (N + D + 16) * EPS32 * (g_logits.abs().T @ x.double().abs()) + 1e-12
    assert aux_scale.count == 1 and aux_scale.value == pytest.approx(expected.item(), rel=1e-5)
    assert bool(((moe.router.weight.grad.double() - g_w).abs() <= bound).all())
    assert g_w.abs().max() > 1e3 * bound.max()  # the check means something


def test_bias_update_rule():
    """``bias += rate * sign(mean(load) - load)`` per layer, with ``load`` summed over ranks."""
    cfg = moe_config(bias_update_rate=0.1, moe_ffn_hidden=12)
    model = torch.nn.ModuleList([MoE(cfg, AuxLossScale()), MoE(cfg, AuxLossScale())])
    loads = [torch.tensor([4.0, 0, 2, 2, 2, 1, 3, 2]), torch.tensor([0.0, 0, 0, 0, 0, 0, 0, 16])]
    other = torch.tensor([0.0, 4, 2, 2, 2, 3, 1, 2])  # the other rank's counts
    before = []
    for moe, load, seed in zip(model, loads, (5, 6), strict=True):
        moe.router.load.copy_(load)
        moe.router.expert_bias.normal_(generator=torch.Generator().manual_seed(seed))
        before.append(moe.router.expert_bias.clone())
    update_balance_bias(list(model), torch.stack([load + other for load in loads]).double(), 0.1)
    for moe, load, old in zip(model, loads, before, strict=True):
        total = load + other
        sign = torch.where(total < total.mean(), 1.0, torch.where(total > total.mean(), -1.0, 0.0))
        assert torch.equal(moe.router.expert_bias, old + 0.1 * sign)
    # layer 0: unbalanced on this rank, balanced over both: its bias stays (the sum was used)
    assert torch.equal(model[0].router.expert_bias, before[0]) and not torch.equal(model[1].router.expert_bias, before[1])


# ----------------------------------------------------------------------------- expert matmuls


@pytest.mark.parametrize(("counts", "experts"), [([3, 0, 2, 4, 1, 2], [0, 1, 2, 0, 1, 2]), ([0, 5, 0, 3], [0, 1, 0, 1]),
                                                 ([0, 0], [0, 1])],
                         ids=["two-sources", "empty-segments", "no-rows"])
def test_swiglu_segments_equal_row_by_row(counts, experts):
    """Segments as an ep rank receives them ((source, local expert) blocks, an expert owning
    several) give each row its expert's SwiGLU, with the gradients of that row-by-row definition;
    float64, so the bound (1e-9 on values of order 1) is ~1e6 times the rounding of the K <= 24
    dot products. With no rows the graph still reaches x and the weights (zero gradients)."""
    gen = torch.Generator().manual_seed(len(counts))
    n, d, h, n_exp = sum(counts), 16, 24, 3
    x0 = torch.randn(n, d, generator=gen, dtype=torch.float64)
    w0 = [torch.randn(n_exp, *shape, generator=gen, dtype=torch.float64) * 0.3 for shape in ((h, d), (h, d), (d, h))]
    dy = torch.randn(n, d, generator=gen, dtype=torch.float64)
    expert_of_row = [e for c, e in zip(counts, experts, strict=True) for _ in range(c)]

    def row_by_row(x, w1, w3, w2):
        rows = [w2[e] @ (torch.nn.functional.silu(w1[e] @ x[i]) * (w3[e] @ x[i])) for i, e in enumerate(expert_of_row)]
        return torch.stack(rows) if rows else x.new_zeros(0, d) + 0 * (w1.sum() + w3.sum() + w2.sum()) + 0 * x.sum()

    grads = []
    for fn in (lambda x, *w: swiglu_experts(x, counts, *w, experts=experts), row_by_row):
        x, ws = x0.clone().requires_grad_(), [w.clone().requires_grad_() for w in w0]
        y = fn(x, *ws)
        y.backward(dy)
        grads.append([y.detach(), x.grad, *(w.grad for w in ws)])
    for got, want in zip(*grads, strict=True):
        assert got is not None and want is not None and got.shape == want.shape
        assert bool(((got - want).abs() <= 1e-9).all())


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 10, 0], [0, 4, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]],
                         ids=["middle-empty", "one-expert", "first-last-empty", "no-rows", "one-each"])
def test_grouped_mm_matches_loop(counts):
    """Forward and both gradients of the grouped kernel equal the loop's to the dot-product
    bound gamma_K (K: the summed dimension of each product); an empty expert's gradient is 0."""
    gen = torch.Generator().manual_seed(sum(counts))
    n, k_in, k_out = sum(counts), 24, 12
    x0, w0 = torch.randn(n, k_in, generator=gen), torch.randn(len(counts), k_out, k_in, generator=gen)
    dy = torch.randn(n, k_out, generator=gen)
    results = []
    for fn in (grouped_mm, grouped_mm_loop):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fn(x, w, counts)
        y.backward(dy)
        # no rows: x takes no part in the product (no gradient, as it has no entries)
        results.append((y.detach(), torch.zeros_like(x0) if x.grad is None and n == 0 else x.grad, w.grad))
    (y, gx, gw), (y_ref, gx_ref, gw_ref) = results
    ax, aw, ady = x0.abs().double(), w0.abs().double(), dy.abs().double()
    expert = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    # y = x_e w_e^T (K = k_in); dx = dy w_e (K = k_out); dw_e = dy_e^T x_e (K = counts[e])
    y_mag = torch.stack([ax[i] @ aw[e].T for i, e in enumerate(expert.tolist())]) if n else torch.zeros(0, k_out)
    dx_mag = torch.stack([ady[i] @ aw[e] for i, e in enumerate(expert.tolist())]) if n else torch.zeros(0, k_in)
    dw_mag = torch.stack([ady[expert == e].T @ ax[expert == e] for e in range(len(counts))])
    gamma = 2.02 * EPS32  # two computations, each within gamma_K of the exact value
    assert bool(((y - y_ref).abs() <= gamma * k_in * y_mag).all())
    assert bool(((gx - gx_ref).abs() <= gamma * k_out * dx_mag).all())
    per = torch.tensor([max(c, 1) for c in counts], dtype=torch.float64).view(-1, 1, 1)
    assert bool(((gw - gw_ref).abs() <= gamma * per * dw_mag).all())
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(gw[e], torch.zeros_like(gw[e])) and torch.equal(gw_ref[e], torch.zeros_like(gw[e]))


def test_experts_match_transformers_loop():
    """Our stacked experts (sorted tokens, grouped matmuls, weighted combine) equal transformers'
    ``MixtralExperts`` (a loop over the hit experts, ``index_add``) given the same routing,
    forward and gradients, in float64. Both sum the same products in other orders: within
    (D + H + k) eps64 of the magnitudes; 1e-10 relative is 10^4 above that and 10^9 below a
    wrong expert or weight."""
    tf = pytest.importorskip("transformers")
    h, k, tokens = 12, 2, 40
    cfg = moe_config(moe_ffn_hidden=h, experts_per_token=k)
    gen = torch.Generator().manual_seed(7)
    ours = Experts(cfg).double()
    with torch.no_grad():
        for w in (ours.w1, ours.w3, ours.w2):
            w.copy_(torch.randn(w.shape, generator=gen, dtype=torch.float64) * 0.3)
    theirs = tf.models.mixtral.modeling_mixtral.MixtralExperts(
        tf.MixtralConfig(hidden_size=D, intermediate_size=h, num_local_experts=E)).double()
    with torch.no_grad():
        theirs.gate_up_proj.copy_(torch.cat([ours.w1, ours.w3], 1))
        theirs.down_proj.copy_(ours.w2)
    x0 = torch.randn(tokens, D, generator=gen, dtype=torch.float64)
    # unbalanced routing, expert 5 empty: expert 0 on half the tokens
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
    idx[idx == 5] = 0
    idx[: tokens // 2, 0] = 0
    idx[: tokens // 2, 1] = torch.where(idx[: tokens // 2, 1] == 0, 1, idx[: tokens // 2, 1])
    weights = torch.rand(tokens, k, generator=gen, dtype=torch.float64)
    dy = torch.randn(tokens, D, generator=gen, dtype=torch.float64)
    x1, x2 = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    y_ours = ours(x1.view(4, tokens // 4, D), weights.view(4, -1, k), idx.view(4, -1, k)).view(tokens, D)
    y_theirs = theirs(x2, idx, weights)
    y_ours.backward(dy)
    y_theirs.backward(dy)
    torch.testing.assert_close(y_ours, y_theirs, rtol=0, atol=1e-10 * y_theirs.abs().max().item())
    gate, up = theirs.gate_up_proj.grad.split(h, 1)
    for name, a, b in (("x", x1.grad, x2.grad), ("w1", ours.w1.grad, gate), ("w3", ours.w3.grad, up),
                       ("w2", ours.w2.grad, theirs.down_proj.grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10 * b.abs().max().item(), msg=name)
    assert torch.equal(ours.w1.grad[5], torch.zeros(h, D, dtype=torch.float64))  # the empty expert
