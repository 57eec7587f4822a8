"""The zero-bubble split backward (parallel/pipeline/wsplit.py), in one process.

B (the chunk's backward with linear layers' weight gradients deferred) then W equals the plain
backward bit for bit (``torch.equal``): the deferred weight gradient runs the same autograd nodes
on the same saved input and the same output gradient (the argument is in wsplit's docstring), so
any difference is a bug, not rounding. Also: every parameter's post-accumulate-grad hook fires
once per micro-batch (as in plain backward), B leaves linear weights untouched (W does their
work), and what B keeps for W is exactly each deferred linear's input and output gradient
(bytes equal the analytic formula, less than the activations the plain graph saves).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from hybridpar.config import ModelConfig
from hybridpar.models.llama import Llama
from hybridpar.parallel.pipeline.wsplit import Deferred, WeightGradSplit, deferrable_params
from hybridpar.parallel.recompute import apply_recompute

pytestmark = pytest.mark.numerics

B, T = 2, 8


def _cfg(tie: bool) -> ModelConfig:
    return ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64,
                       max_seq_len=T, tie_embeddings=tie)


def deferred_bytes(cfg: ModelConfig, layers: int, head: bool, tokens: int) -> int:
    """fp32 bytes a chunk keeps from B to W: per layer the inputs of the linear layers (wq/wk/wv
    share the normed input, w1/w3 likewise; wo's and w2's are their own) and the output
    gradient of each of the seven linears; plus the untied head's input and logits gradient."""
    hd = cfg.head_dim
    inputs = cfg.dim + cfg.n_heads * hd + cfg.dim + cfg.ffn_hidden
    grads = cfg.n_heads * hd + 2 * cfg.n_kv_heads * hd + cfg.dim + 2 * cfg.ffn_hidden + cfg.dim
    per_token = layers * (inputs + grads) + (cfg.dim + cfg.vocab_size if head and not cfg.tie_embeddings else 0)
    return 4 * tokens * per_token


def _batches(k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 64, (B, T), generator=gen), torch.randint(0, 64, (B, T), generator=gen))
            for _ in range(k)]


def _loss(model: Llama, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _train(tie: bool, recompute: str, split: bool) -> tuple[dict, dict, list[int], list[dict]]:
    model = Llama(_cfg(tie))
    model.init_weights(3)
    apply_recompute(model, recompute, model.layers, [layer.attention for layer in model.layers])
    fired: dict[str, int] = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, n=name: fired.__setitem__(n, fired.get(n, 0) + 1))
    ws = WeightGradSplit([model]) if split else None
    held, after_b = [], []
    for x, y in _batches(2):
        if ws is None:
            _loss(model, x, y).backward()
            continue
        deferred = Deferred()
        with ws.forward(deferred):
            loss = _loss(model, x, y)
        with ws.backward():
            torch.autograd.backward(loss)
        held.append(deferred.held_bytes())
        after_b.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        deferred.weight_grads()
    if ws is not None:
        ws.remove()
    return {n: p.grad for n, p in model.named_parameters()}, fired, held, after_b


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_split_backward_equals_plain_backward_exactly(tie, recompute):
    ref, ref_fired, _, _ = _train(tie, recompute, split=False)
    got, fired, held, after_b = _train(tie, recompute, split=True)
    for name, g in ref.items():
        assert torch.equal(got[name], g), name
    assert fired == ref_fired == {name: 2 for name in ref}  # once per parameter per micro-batch
    model = Llama(_cfg(tie))
    deferred = {n for n, p in model.named_parameters() if p in deferrable_params(model)}
    assert deferred == {n for n in ref if n.endswith(("wq.weight", "wk.weight", "wv.weight", "wo.weight",
                                                     "w1.weight", "w2.weight", "w3.weight"))
                        or (n == "output.weight" and not tie)}
    # B computed every other gradient and left the linear weights to W (None before the first W)
    assert all((after_b[0][n] is None) == (n in deferred) for n in ref)
    assert held == [deferred_bytes(_cfg(tie), 2, True, B * T)] * 2


def test_split_keeps_less_than_the_plain_graph():
    """Bytes kept from B to W (formula) vs the activations the plain graph saves (measured with
    saved-tensor hooks, distinct storages, parameters excluded)."""
    cfg = _cfg(False)
    model = Llama(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    x, y = _batches(1)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _loss(model, x, y)
    assert deferred_bytes(cfg, 2, True, B * T) < sum(saved.values())


def test_a_linear_on_an_input_without_grad_is_not_deferred():
    """Nothing to send upstream means no B to defer from: the weight gradient is taken in B."""
    lin = torch.nn.Linear(4, 3)
    ws = WeightGradSplit([lin])
    deferred = Deferred()
    with ws.forward(deferred):
        out = lin(torch.randn(5, 4)).sum()
    with ws.backward():
        out.backward()
    assert deferred.linears == [] and lin.weight.grad is not None


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "permuted"])
def test_held_bytes_and_gradients_alike_with_other_saved_tensor_hooks_around(contiguous):
    """A linear whose input is saved as it is skips the pack hooks unless other saved-tensor hooks
    are active (a checkpoint's); both ways W keeps the same storages (the input's, or the copy
    the linear saves of a permuted one, and the output gradient) and the gradients equal plain
    backward's bit for bit."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 5)
    x0 = torch.randn(4, 3, 6) if contiguous else torch.randn(6, 3, 4).permute(2, 1, 0)
    gy = torch.randn(4, 3, 5)
    x = x0.clone().requires_grad_() if contiguous else x0.detach().requires_grad_()
    lin(x).backward(gy)
    ref = (x.grad, lin.weight.grad.clone(), lin.bias.grad.clone())
    ws = WeightGradSplit([lin])
    held = []
    for outer in (False, True):
        lin.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_() if contiguous else x0.detach().requires_grad_()
        deferred = Deferred()
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with hooks if outer else contextlib.nullcontext(), ws.forward(deferred):
            y = lin(x)
        with ws.backward():
            y.backward(gy)
        held.append(deferred.held_bytes())
        deferred.weight_grads()
        assert torch.equal(x.grad, ref[0]) and torch.equal(lin.weight.grad, ref[1]) and torch.equal(lin.bias.grad, ref[2])
    # the input (or its saved copy: same size) and the output gradient, in fp32
    assert held == [4 * (x0.numel() + gy.numel())] * 2
