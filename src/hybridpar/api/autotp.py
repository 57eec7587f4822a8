"""AutoTP: tensor parallelism from a Hugging Face model's own plan.

Hugging Face ``transformers`` models carry their tensor-parallel plan: ``config.base_model_tp_plan``
(module-name patterns of the base model, e.g. ``"layers.*.self_attn.q_proj": "colwise"``) and the
model's ``_tp_plan`` (the same under the model's names, plus ``"lm_head": "colwise_gather_output"``
and ``"model.embed_tokens": "embedding_rowwise"``). :func:`autotp` reads that plan, translates
each style onto :func:`~hybridpar.api.tp.parallelize_module`'s (:data:`HF_STYLES`) and applies it:

* ``colwise`` / ``local_colwise`` -> ``column``; ``colwise_rep`` / ``colwise_gather_output`` ->
  ``column`` with ``gather_output`` (the LM head: the model's own loss sees full logits);
* ``rowwise`` / ``local_rowwise`` -> ``row``; ``rowwise_rep`` / ``rowwise_split_input`` -> ``row``
  with a replicated input (split first);
* ``embedding_rowwise`` -> ``embedding`` (split along the vocabulary);
* ``replicated_with_grad_allreduce`` (Qwen3's per-head q/k norms) -> replicated, and the
  parameters' gradients, partial sums over this rank's heads, summed over tp
  (:attr:`AutoTP.partial`);
* ``replicate`` / ``local`` and Mixtral-style packed experts (``moe_tp_experts``,
  ``packed_colwise``, ``packed_rowwise``, ``moe_identity_expert`` and the entries under them) ->
  replicated: every tp rank runs the whole expert block on the replicated hidden state, which
  is exact; attention is split as planned (expert parallelism is the CLI families' ``ep``).

Anything else (``sequence_parallel``, ``embedding_colwise``, ``all_reduce``, ...) is refused
naming the entry. Heads: tp must divide both the attention heads and the KV heads (each rank
runs whole heads; HF attention reshapes with ``-1`` heads, so it runs its local heads as is;
integer head-count attributes on attention modules, where a model keeps them, are divided).
A head tied to the embedding stays tied: the vocab-parallel embedding and the column head split
the same ``[vocab, hidden]`` rows, so they share one shard (the vocabulary must divide by tp).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from hybridpar.api.tp import PlanStyle, parallelize_module
from hybridpar.distributed.mesh import Axis

__all__ = ["HF_STYLES", "AutoTP", "autotp", "check_autotp", "hf_tp_plan"]

_GATHERED = {"style": "column", "gather_output": True}
_SPLIT_INPUT = {"style": "row", "input_is_parallel": False}
_REPLICATED = "replicated"  # stays whole on every tp rank
_PARTIAL = "partial"  # whole on every tp rank, gradients summed over tp
_EXPERTS = "experts"  # the module and every plan entry under it stay replicated

#: Hugging Face style -> parallelize_module style (or one of the replicated markers)
HF_STYLES: dict[str, PlanStyle] = {
    "colwise": "column", "local_colwise": "column",
    "colwise_rep": _GATHERED, "colwise_gather_output": _GATHERED,
    "rowwise": "row", "local_rowwise": "row",
    "rowwise_rep": _SPLIT_INPUT, "rowwise_split_input": _SPLIT_INPUT,
    "embedding_rowwise": "embedding",
    "replicated_with_grad_allreduce": _PARTIAL,
    "replicate": _REPLICATED, "local": _REPLICATED,
    "moe_tp_experts": _EXPERTS, "packed_colwise": _EXPERTS, "packed_rowwise": _EXPERTS,
    "moe_identity_expert": _EXPERTS,
}
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_heads", "n_kv_heads")


@dataclass(frozen=True)
class AutoTP:
    """What :func:`autotp` did: the plan it applied (``parallelize_module``'s spelling) and the
    replicated parameters whose gradients are partial sums over tp (to sum after backward)."""

    plan: dict[str, PlanStyle]
    partial: frozenset[str]


def hf_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The model's own tensor-parallel plan under its module names: ``model._tp_plan`` (the
    whole model's, ``transformers`` >= 4.50), else ``config.base_model_tp_plan`` under the base
    model's prefix; None if it carries none."""
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, Mapping) and own:
        return dict(own)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if not base:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    sub = prefix + "." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    return {sub + pattern: style for pattern, style in base.items()}


def _translate(plan: Mapping[str, str], names: list[str]) -> tuple[dict[str, PlanStyle], list[str]]:
    """(parallelize_module plan, patterns of the partial-gradient modules) from the HF plan;
    entries that match no module of this model are dropped (HF plans list optional modules)."""
    unknown = {p: s for p, s in plan.items() if s not in HF_STYLES}
    if unknown:
        pattern, style = next(iter(unknown.items()))
        raise ValueError(f"AutoTP: the model's tensor-parallel plan entry {pattern!r} has style {style!r}, which "
                         f"hybridpar does not map (supported: {sorted(HF_STYLES)}); pass tensor_parallel_plan "
                         "= {pattern: 'column' | 'row' | 'embedding'} to initialize() instead")
    experts = [p for p, s in plan.items() if HF_STYLES[s] == _EXPERTS]
    out: dict[str, PlanStyle] = {}
    partial: list[str] = []
    for pattern, style in plan.items():
        ours = HF_STYLES[style]
        if ours in (_REPLICATED, _EXPERTS) or any(pattern.startswith(e + ".") for e in experts):
            continue
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            continue
        if ours == _PARTIAL:
            partial.append(pattern)
        else:
            out[pattern] = ours
    return out, partial


def _check_heads(model: nn.Module, tp: int) -> None:
    """tp must divide the attention and KV heads (each rank runs whole heads)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    for what, n in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if isinstance(n, int) and n % tp:
            fits = [d for d in range(1, n + 1) if n % d == 0 and heads % d == 0 and kv % d == 0]
            raise ValueError(f"AutoTP: tensor_parallel_size = {tp} does not divide the model's {what} = {n} "
                             f"(attention heads {heads}, KV heads {kv}); each tp rank runs whole heads: use a "
                             f"tensor_parallel_size in {fits}")


def _tied_pair(model: nn.Module, plan: Mapping[str, PlanStyle]) -> tuple[str, str] | None:
    """(embedding name, head name) if the output head is tied to the input embedding and the
    plan splits them; refused if the plan splits them in a way that cannot keep them tied."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    emb, head = (get_in() if get_in else None), (get_out() if get_out else None)
    if emb is None or head is None or getattr(head, "weight", None) is not getattr(emb, "weight", None):
        return None
    names = {id(m): n for n, m in model.named_modules()}
    emb_name, head_name = names[id(emb)], names[id(head)]
    style = {n: next((s for p, s in plan.items() if fnmatch.fnmatchcase(n, p)), None) for n in (emb_name, head_name)}
    if style[emb_name] is None and style[head_name] is None:
        return None
    head_style = style[head_name]
    if style[emb_name] != "embedding" or not isinstance(head_style, Mapping) or not head_style.get("gather_output"):
        raise ValueError(f"AutoTP: {head_name!r} is tied to {emb_name!r} but the plan splits them as "
                         f"{style[head_name]!r} and {style[emb_name]!r}; a tied head can be split only as a "
                         "vocab-parallel embedding and a column head with gather_output")
    return emb_name, head_name


def _local_head_counts(model: nn.Module, split: list[str], tp: int) -> None:
    """Divide integer head-count attributes of the modules whose children were split by column
    (attention modules of models that keep them; ``transformers`` 5.x reshapes with -1 instead)."""
    parents = {n.rpartition(".")[0] for n in split} - {""}
    for name, mod in model.named_modules():
        if name in parents:
            for attr in _HEAD_ATTRS:
                value = getattr(mod, attr, None)
                if isinstance(value, int) and not isinstance(value, bool) and value % tp == 0:
                    setattr(mod, attr, value // tp)


def check_autotp(model: nn.Module, tp: int, plan: Mapping[str, str] | None = None) -> tuple[dict[str, PlanStyle], list[str]]:
    """Validate AutoTP of ``model`` at tensor-parallel size ``tp`` without changing it (no process
    group needed: :func:`~hybridpar.api.front.initialize` calls it before creating any) and
    return (the ``parallelize_module`` plan, patterns of the partial-gradient modules)."""
    plan = hf_tp_plan(model) if plan is None else dict(plan)
    if not plan:
        raise ValueError(f"AutoTP: tensor_parallel_size = {tp} but the model ({type(model).__name__}) carries "
                         "no tensor-parallel plan (config.base_model_tp_plan / _tp_plan); pass tensor_parallel_plan "
                         "= {module pattern: 'column' | 'row' | 'embedding'} to initialize() (docs/reference/api.md)")
    ours, partial = _translate(plan, [n for n, _ in model.named_modules() if n])
    if tp > 1:
        _check_heads(model, tp)
        tied = _tied_pair(model, ours)
        vocab = 0 if tied is None else model.get_input_embeddings().weight.shape[0]
        if tied is not None and vocab % tp:
            raise ValueError(f"AutoTP: {tied[1]!r} is tied to {tied[0]!r} and the vocabulary ({vocab}) is not "
                             f"divisible by tensor_parallel_size = {tp}; pad it (resize_token_embeddings("
                             f"pad_to_multiple_of={tp})) or pick a tp that divides it")
    return ours, partial


def autotp(model: nn.Module, axis: Axis, plan: Mapping[str, str] | None = None) -> AutoTP:
    """Split ``model`` over the tensor-parallel ``axis`` by its own Hugging Face plan (or the
    given one, in Hugging Face's style names), in place; see the module doc. Raises
    ``ValueError`` (:func:`check_autotp`) for a model without a plan (naming what to pass
    instead), a style with no counterpart, heads tp does not divide, and a tied head the plan
    cannot keep tied."""
    ours, partial_patterns = check_autotp(model, axis.size, plan)
    if axis.size == 1:
        return AutoTP(ours, frozenset())
    names = [n for n, _ in model.named_modules() if n]
    tied = _tied_pair(model, ours)
    if tied is not None:  # a parameter of its own for the swap; tied again to the embedding's shard after
        emb, head = (model.get_submodule(n) for n in tied)
        head.weight = nn.Parameter(emb.weight.detach(), requires_grad=emb.weight.requires_grad)
    parallelize_module(model, axis, ours)
    if tied is not None:
        emb, head = (model.get_submodule(n) for n in tied)
        head.weight = emb.weight
    _local_head_counts(model, [n for n in names if any(fnmatch.fnmatchcase(n, p) for p, s in ours.items()
                                                       if _is_column(s))], axis.size)
    partial = frozenset(f"{n}.{pn}" for n, m in model.named_modules()
                        if any(fnmatch.fnmatchcase(n, p) for p in partial_patterns)
                        for pn, _ in m.named_parameters(recurse=False))
    return AutoTP(ours, partial)


def _is_column(style: Any) -> bool:
    return style == "column" or (isinstance(style, Mapping) and style.get("style") == "column")
