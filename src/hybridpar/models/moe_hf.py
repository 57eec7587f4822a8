"""Hugging Face names and config keys shared by the Llama-like MoE families (Mixtral, Qwen3-MoE).

An MoE layer ``L`` holds our router ``layers.L.feed_forward.router.weight [E, D]`` and stacked
experts ``layers.L.feed_forward.experts.w1``/``w3 [E, H, D]`` (gate, up) and ``w2 [E, D, H]``
(down). Hugging Face stores them in one of two layouts; import reads either:

* **per expert** (the Hub checkpoints, and what transformers 5.x ``save_pretrained`` still
  writes): ``model.layers.L.<block>.experts.<e>.<gate|up|down>.weight`` (``[H, D]``/``[D, H]``)
  and the router ``model.layers.L.<block>.gate.weight``;
* **fused** (transformers 5.x's modules in memory, which its ``from_pretrained`` also reads):
  ``model.layers.L.mlp.experts.gate_up_proj [E, 2H, D]`` (gate rows, then up rows) and
  ``model.layers.L.mlp.experts.down_proj [E, D, H]``.

Both are read lazily (:mod:`hybridpar.models.lazy`): an expert-parallel rank reads only its
experts' tensors, a tensor-parallel rank only its rows of each. Export writes the per-expert
layout, which transformers 4.x and 5.x both load. The attention, norms and dense layers keep
Llama's names (:class:`~hybridpar.models.llama.hf.LlamaHF`).

Config: ``num_experts_per_tok`` is ``experts_per_token``; ``router_aux_loss_coef`` becomes
``aux_loss_coef`` as is, although transformers' loss (only with ``output_router_logits``, which
is ignored here) pools all layers' tokens and counts each of the ``k`` choices, while ours is a
sum of per-layer losses over slot fractions (:mod:`hybridpar.models.moe`): neither changes
logits. What these formats cannot state (sigmoid scores, shared experts, a balancing bias) is
refused on export, naming the key.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from torch import Tensor

from hybridpar.config import ModelConfig
from hybridpar.models.family import HFError, bad_value, unexportable
from hybridpar.models.lazy import Narrowed, Stacked, shape_of
from hybridpar.models.llama.hf import LlamaHF, llama_hf_config

__all__ = ["MoEHF", "moe_fields"]

_OURS_RE = re.compile(r"layers\.(\d+)\.feed_forward\.(router\.weight|experts\.w[123])")
# model.layers.L.<block>.(gate.weight | experts.<e>.<linear>.weight | experts.<fused>)
_HF_RE = re.compile(r"model\.layers\.(\d+)\.(\w+)\.(?:(gate\.weight)|experts\.(\d+)\.(\w+)\.weight|"
                    r"experts\.(gate_up_proj|down_proj))")


def moe_fields(c: Mapping[str, Any], where: str, experts_keys: tuple[str, ...], defaults: tuple[int, int]
               ) -> dict[str, Any]:
    """The :class:`ModelConfig` MoE fields of a ``config.json`` ``c``: the expert count (under
    the first of ``experts_keys`` present; several present must agree), top-k and the
    load-balancing coefficient; softmax routing without shared experts or balancing bias.
    ``defaults``: transformers' (experts, top-k) for this family, for keys ``c`` lacks."""
    present = [k for k in experts_keys if c.get(k) is not None]
    n = c[present[0]] if present else defaults[0]
    present = present or [experts_keys[0]]
    for key in present[1:]:
        if c[key] != n:
            raise bad_value(where, key, c[key], f"it contradicts {present[0]} = {n}")
    if not isinstance(n, int) or n < 0:
        raise bad_value(where, present[0], n, "the number of experts is an integer >= 0")
    k = c.get("num_experts_per_tok", defaults[1])
    if n and (not isinstance(k, int) or not 1 <= k <= n):
        raise bad_value(where, "num_experts_per_tok", k, f"each token picks between 1 and {present[0]} = {n} experts")
    coef = c.get("router_aux_loss_coef", 0.001)  # transformers' default for both families
    return dict(n_experts=n, experts_per_token=k, aux_loss_coef=float(coef), z_loss_coef=0.0,
                bias_update_rate=0.0, router_score="softmax", n_shared_experts=0)


class MoEHF(LlamaHF):
    """Llama's names plus routers and stacked experts (module doc). Subclasses set the MoE
    block's module name and the per-expert linears' names."""

    #: the MoE block's module in HF keys: written on export, read on import with ``aliases``
    block: ClassVar[str] = "mlp"
    aliases: ClassVar[tuple[str, ...]] = ()
    #: our stacked weight -> the per-expert HF linear (gate, up, down)
    linears: ClassVar[dict[str, str]] = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    #: the ModelConfig features the family's attention has (qk_norm for Qwen3-MoE)
    qk_norm: ClassVar[bool] = False

    def hf_key(self, name: str) -> str:
        """HF key of ``name``; a stacked expert weight gets the per-expert keys' pattern (``*``)."""
        m = _OURS_RE.fullmatch(name)
        if m is None:
            return super().hf_key(name)
        layer, what = m.groups()
        if what == "router.weight":
            return f"model.layers.{layer}.{self.block}.gate.weight"
        return f"model.layers.{layer}.{self.block}.experts.*.{self.linears[what.split('.')[1]]}.weight"

    def hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        """Llama's config.json keys for ``cfg`` after :meth:`check_exportable` (MoE allowed)."""
        self.check_exportable(cfg)
        return llama_hf_config(cfg, self.model_type, self.architecture, moe=True)

    def from_hf_key(self, key: str) -> str:
        """Our name of HF ``key``; KeyError for expert tensors (parts of ours: see :meth:`to_ours`)."""
        m = _HF_RE.fullmatch(key)
        if m is not None and m.group(3) and m.group(2) in (self.block, *self.aliases):
            return f"layers.{m.group(1)}.feed_forward.router.weight"
        return super().from_hf_key(key)

    def to_ours(self, hf: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        inverse = {v: k for k, v in self.linears.items()}
        per_expert: dict[tuple[str, str], dict[int, tuple[str, Any]]] = {}
        given: dict[str, str] = {}  # our name -> the HF key(s) it came from

        def once(name: str, source: str, value: Any) -> tuple[str, Any]:
            if name in given:
                raise HFError(f"{source} and {given[name]} both hold {name} (experts stored per expert and fused?)")
            given[name] = source
            return name, value

        for key, value in hf.items():
            m = _HF_RE.fullmatch(key)
            if m is None or m.group(2) not in (self.block, *self.aliases) or (m.group(5) and m.group(5) not in inverse):
                yield from super().to_ours({key: value})
                continue
            layer, _, router, expert, linear, fused = m.groups()
            ours = f"layers.{layer}.feed_forward"
            if router:
                yield once(f"{ours}.router.weight", key, value)
            elif fused == "down_proj":
                yield once(f"{ours}.experts.w2", key, value)
            elif fused == "gate_up_proj":
                shape = shape_of(value)
                if len(shape) != 3 or shape[1] % 2:
                    raise HFError(f"{key} has shape {shape}; a fused gate_up_proj is [experts, 2 * expert hidden, "
                                  "hidden] (gate rows, then up rows)")
                half = shape[1] // 2
                yield once(f"{ours}.experts.w1", key, Narrowed(value, 1, 0, half))
                yield once(f"{ours}.experts.w3", key, Narrowed(value, 1, half, 2 * half))
            else:
                group = per_expert.setdefault((layer, inverse[linear]), {})
                e = int(expert)
                if e in group:
                    raise HFError(f"{key} and {group[e][0]} both hold expert {e} of layer {layer}")
                group[e] = (key, value)
        for (layer, w), group in per_expert.items():
            name = f"layers.{layer}.feed_forward.experts.{w}"
            missing = [e for e in range(max(group) + 1) if e not in group]
            if missing:
                raise HFError(f"expert {missing[0]} of layer {layer} is missing: there is no "
                              f"{self.hf_key(name).replace('*', str(missing[0]))} (found experts {sorted(group)})")
            keys, values = zip(*(group[e] for e in range(len(group))), strict=True)
            yield once(name, self.hf_key(name), Stacked(values, keys))

    def to_hf(self, ours: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Our state dict -> HF's per-expert layout (each expert's tensor its own copy)."""
        out: dict[str, Tensor] = {}
        for name, t in ours.items():
            m = _OURS_RE.fullmatch(name)
            if m is None or m.group(2) == "router.weight":
                out[self.hf_key(name)] = t
                continue
            pattern = self.hf_key(name)
            for e in range(t.shape[0]):
                out[pattern.replace("*", str(e))] = t[e].clone()
        return out

    def check_exportable(self, cfg: ModelConfig) -> None:
        """HFError naming the first ``model.*`` value this family's config.json cannot state."""
        checks = [
            ("router_score", "softmax", "its router scores experts with a softmax"),
            ("n_shared_experts", 0, "it has no shared experts"),
            ("bias_update_rate", 0.0, "its router has no balancing bias (the trained bias would change the "
                                      "routing); export a model trained without it"),
            ("qk_norm", self.qk_norm, f"its attention {'has' if self.qk_norm else 'has no'} q/k norms"),
            ("qkv_bias", False, "its attention has no biases"),
        ]
        for key, want, why in checks:
            if getattr(cfg, key) != want:
                raise unexportable(key, getattr(cfg, key), self.architecture, why)
