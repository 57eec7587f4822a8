"""AutoTP: a Hugging Face ``AutoModelForCausalLM`` (Llama with its head tied to the embedding,
Qwen2 with q/k/v biases, Qwen3 with per-head q/k norms, Mixtral with packed experts; tiny configs, ``from_config``, nothing
downloaded) split by its own tensor-parallel plan through ``initialize(model,
{"tensor_parallel_size": 2})``: logits, loss and gradients equal the single process's, a few
AdamW steps train the same weights (also at dp2 x tp2 with ZeRO-3), and ``full_state_dict``
gives back the model's own names and shapes. Refusals: no plan, heads tp does not divide, a
style with no counterpart.

Tolerances: logits and gradients differ only in summation order (a row-parallel sum of two
partials, the vocab-parallel lookup's sum with zeros): every entry within 1e-5 of the reference
tensor's largest entry (as tests/test_tensor_parallel.py). Training: numerics' layout rule."""

from __future__ import annotations

import functools

import pytest
import torch
from numerics import LOSS_RTOL, adam_noise_cap, layout_weight_atol
from torch import nn

import hybridpar
from hybridpar.api.autotp import check_autotp
from hybridpar.api.tp import full_tensor_parallel_state_dict
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

pytestmark = pytest.mark.numerics  # layout equality: also run under other ATEN_CPU_CAPABILITY (Makefile)

transformers = pytest.importorskip("transformers")

STEPS, LR, BATCH, SEQ, VOCAB = 3, 1e-3, 4, 16, 256
CFG = {"lr": LR, "grad_clip": 1.0, "betas": (0.9, 0.95)}
RTOL = 1e-5  # relative to the largest entry of the reference tensor


def make_model(family: str, tp_size: int = 2) -> nn.Module:
    """A tiny causal LM of ``family`` from its config, the same weights on every rank."""
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="eager",
                  bos_token_id=0, eos_token_id=0, pad_token_id=None)
    config = {"llama": lambda: transformers.LlamaConfig(**common, tie_word_embeddings=True),
              "qwen2": lambda: transformers.Qwen2Config(**common, tie_word_embeddings=False),
              "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=False),
              "mixtral": lambda: transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                                            tie_word_embeddings=False)}[family]()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Every entry within RTOL of ``expected``'s largest entry."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    tol = RTOL * float(expected.abs().max().clamp_min(1e-30))
    err = float((actual - expected).abs().max())
    assert err <= tol, f"{what}: max error {err:.3e} > {tol:.3e}"


@functools.cache
def reference(family: str) -> dict:
    """One process, plain PyTorch: first-step logits and gradients, per-step losses, final weights."""
    model = make_model(family)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=CFG["betas"], weight_decay=0.0)
    out: dict = {"losses": []}
    for step in range(STEPS):
        opt.zero_grad()
        result = model(input_ids=batch(step), labels=batch(step))
        result.loss.backward()
        if step == 0:
            out["norm"] = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
            out["logits"] = result.logits.detach()
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        out["losses"].append(float(result.loss.detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), CFG["grad_clip"])
        opt.step()
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def _run(rank: int, world: int, family: str, dp: int, stage: int) -> dict:
    tp = world // dp
    with ParallelDims(dp=dp, tp=tp).build() as topo:
        engine = hybridpar.initialize(make_model(family), {**CFG, "zero_stage": stage, "tensor_parallel_size": tp},
                                      topo=topo)
        m = engine.module
        kinds = (type(m.model.embed_tokens), type(m.model.layers[0].self_attn.k_proj),
                 type(m.model.layers[0].self_attn.o_proj), type(m.lm_head))
        rows = slice(topo.dp.rank * BATCH // dp, (topo.dp.rank + 1) * BATCH // dp)
        out: dict = {"kinds": kinds, "tied": m.lm_head.weight is m.model.embed_tokens.weight, "losses": []}
        for step in range(STEPS):
            x = batch(step)[rows]
            result = engine(input_ids=x, labels=x)
            engine.backward(result.loss)
            if step == 0 and stage == 0 and dp == 1:
                out["norm"] = float(engine.grad_norm())  # reduces (tp-partial gradients summed) once
                out["logits"] = result.logits.detach()
                grads = {n: p.grad for n, p in m.named_parameters()}
                out["grads"] = full_tensor_parallel_state_dict(grads, engine.tp_sharded, topo.tp)
            engine.step()
            out["losses"].append(float(topo.comm.all_reduce(result.loss.detach().clone(), topo.dp)) / dp)
        out["state"] = engine.full_state_dict()
        return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mixtral"])
def test_autotp_tp2_matches_one_process(dist_run, family):
    ref = reference(family)
    for r in dist_run(2, _run, family, 1, 0):
        assert r["kinds"] == (VocabParallelEmbedding, ColumnParallelLinear, RowParallelLinear, ColumnParallelLinear)
        assert r["tied"] == (family == "llama")  # the tied head shares the embedding's shard
        close(r["logits"], ref["logits"], "logits")
        assert r["norm"] == pytest.approx(ref["norm"], rel=RTOL)
        assert r["grads"].keys() == ref["grads"].keys()
        for n, g in ref["grads"].items():
            close(r["grads"][n], g, f"grad {n}")
        _check_training(r, ref)


def _check_training(r: dict, ref: dict) -> None:
    assert r["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL)
    assert r["state"].keys() == ref["state"].keys()  # the model's own names (both of a tied weight)
    for k, v in ref["state"].items():
        assert r["state"][k].shape == v.shape, k
        diff = (r["state"][k] - v).abs()
        atol, cap = layout_weight_atol(LR, STEPS), adam_noise_cap(LR, STEPS)
        assert int((diff > atol).sum()) <= max(1, v.numel() // 1000) and float(diff.max()) <= cap, k


def test_autotp_dp2_tp2_zero3_matches_one_process(dist_run):
    """The tied Llama: its head and embedding one vocab-parallel shard, in ZeRO-3's root unit."""
    ref = reference("llama")
    for r in dist_run(4, _run, "llama", 2, 3):
        _check_training(r, ref)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)


def test_autotp_refusals():
    with pytest.raises(ValueError, match="carries no tensor-parallel plan.*tensor_parallel_plan"):
        hybridpar.initialize(MLP(), {"tensor_parallel_size": 2})
    assert not torch.distributed.is_initialized()  # refused before any process group
    with pytest.raises(ValueError, match="does not divide the model's num_key_value_heads = 2.*in \\[1, 2\\]"):
        hybridpar.initialize(make_model("llama"), {"tensor_parallel_size": 4})
    with pytest.raises(ValueError, match="style 'sequence_parallel', which hybridpar does not map"):
        check_autotp(make_model("qwen2"), 2, {"model.norm": "sequence_parallel"})
    tied = make_model("llama")
    tied.resize_token_embeddings(VOCAB + 1)
    with pytest.raises(ValueError, match="tied to 'model.embed_tokens' and the vocabulary \\(257\\)"):
        check_autotp(tied, 2)
    with pytest.raises(ValueError, match="'lm_head' is tied to 'model.embed_tokens' but the plan splits them"):
        check_autotp(make_model("llama"), 2, {"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise"})
