"""RoPE scaling (``rope_type`` linear, dynamic, yarn, llama3): tiny random Hugging Face Llamas of
each type load and give transformers' logits, alone, under context parallelism (zigzag
positions) and with packed documents (positions restarting per document); other types are
refused by name, and the planner takes any type.

Tolerance: 1e-5 relative on logits of size ~1 (float32 rounding; the same math in the same order).
Weights are drawn wide (uniform +-0.3) so the rotation visibly moves the logits: each scaled
model's logits differ from the unscaled model's by far more than the tolerance.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hybridpar.cli import main
from hybridpar.config import ModelConfig
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.models.hf import HFError, load_hf_state_dict, model_config_from_hf, save_hf
from hybridpar.models.llama import Documents, Llama
from hybridpar.models.llama.parallelize import attention_modules
from hybridpar.parallel.context import unshard_sequence, zigzag_positions, zigzag_shard
from hybridpar.parallel.context_model import enable_context_parallel

transformers = pytest.importorskip("transformers")

SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-5)
ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16.0},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.7,
                    "mscale_all_dim": 1.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}
TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def make_hf(path, rope: dict | None):
    """A random HF Llama with RoPE ``rope`` (None: unscaled), weights uniform +-0.3, saved to ``path``."""
    torch.manual_seed(0)
    params = {"rope_type": "default", **(rope or {}), "rope_theta": 10000.0}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, rope_parameters=params)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.uniform_(-0.3, 0.3)
    model.save_pretrained(path)
    return model.eval()


def ours(path) -> Llama:
    model = Llama(model_config_from_hf(path))
    model.load_state_dict(load_hf_state_dict(path), strict=True)
    return model.eval()


def tokens(t: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, t), generator=torch.Generator().manual_seed(1))


def hf_documents(hf, x: torch.Tensor, cut: int) -> torch.Tensor:
    """transformers' logits for two packed documents, each run alone: [0, cut) and [cut, T)."""
    return torch.cat([hf(input_ids=x[:, :cut]).logits, hf(input_ids=x[:, cut:]).logits], dim=1)


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_scaled_rope_matches_transformers(tmp_path, kind):
    hf = make_hf(tmp_path / "hf", ROPES[kind])
    plain = make_hf(tmp_path / "plain", None)
    model = ours(tmp_path / "hf")
    assert model.cfg.rope_type == kind.split("-")[0]
    # dynamic NTK rescales only past max_position_embeddings = 64 (transformers recomputes there)
    for t in (48, 100):
        x = tokens(t)
        with torch.no_grad():
            want = hf(input_ids=x).logits
            err = rel_err(model(x), want)
            moved = rel_err(plain(input_ids=x).logits, want)
        print(f"{kind} T={t}: rel err {err:.1e}, vs unscaled {moved:.1e}")
        assert err <= TOL
        if kind != "dynamic" or t > 64:
            assert moved > 1e3 * TOL  # the scaling matters at this length
    cut = 20
    segments = (torch.arange(48) >= cut).long().expand(2, 48)
    x = tokens(48)
    with torch.no_grad():
        assert rel_err(model(x, docs=Documents.from_segments(segments)), hf_documents(hf, x, cut)) <= TOL


@pytest.mark.parametrize("kind", ["llama3", "yarn"])
def test_scaled_rope_round_trips_through_config_json(tmp_path, kind):
    hf = make_hf(tmp_path / "hf", ROPES[kind])
    model = ours(tmp_path / "hf")
    save_hf(model.state_dict(), model.cfg, tmp_path / "out")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert dataclasses.replace(model_config_from_hf(tmp_path / "out"), preset=model.cfg.preset) == model.cfg
    x = tokens(40)
    with torch.no_grad():
        assert rel_err(back(input_ids=x).logits, hf(input_ids=x).logits) <= TOL


def _cp_vs_transformers(rank: int, world: int, paths: dict) -> dict:
    """Each rope type under cp = world: zigzag shards vs transformers on the whole sequence, and
    packed documents sharded the same way vs transformers on each document alone."""
    t, cut = 16 * world, 4 * world + 3
    x = tokens(t)
    segments = (torch.arange(t) >= cut).long().expand(2, t)
    errs = {}
    with ParallelDims(cp=world).build() as topo:
        axis = topo.cp
        for kind, path in paths.items():
            hf = transformers.LlamaForCausalLM.from_pretrained(path).float().eval()
            model = ours(path)
            enable_context_parallel(model, axis, attention_modules(model))
            positions = zigzag_positions(t, axis)
            docs = Documents.from_segments(segments).index_select(1, positions)
            with torch.no_grad():
                full = unshard_sequence(model(zigzag_shard(x, axis), positions), axis, 1, "zigzag")
                packed = unshard_sequence(model(zigzag_shard(x, axis), positions, docs=docs), axis, 1, "zigzag")
                errs[kind] = (rel_err(full, hf(input_ids=x).logits), rel_err(packed, hf_documents(hf, x, cut)))
    return errs


def test_scaled_rope_under_context_parallel(tmp_path, dist_run):
    paths = {}
    for kind, rope in ROPES.items():
        make_hf(tmp_path / kind, rope)
        paths[kind] = str(tmp_path / kind)
    for errs in dist_run(2, _cp_vs_transformers, paths):
        print(errs)
        assert all(e <= TOL for pair in errs.values() for e in pair), errs


def test_other_rope_types_are_refused_by_name(tmp_path):
    make_hf(tmp_path, None)
    c = json.loads((tmp_path / "config.json").read_text())
    c["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0], "long_factor": [1.0]}
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(HFError, match="rope_type 'longrope' is not implemented; supported: default, linear, dynamic, "
                                      "yarn, llama3"):
        model_config_from_hf(tmp_path)
    with pytest.raises(ValueError, match="model.rope_type = 'ntk' is not supported"):
        Llama(ModelConfig(rope_type="ntk"))


def test_planner_takes_any_rope_type(tmp_path, capsys):
    """Memory and time do not depend on the rope type: llama3 (Llama 3.1) and one the model
    does not implement both plan."""
    c = {**SHAPE, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "rope_theta": 5e5,
         "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    for kind in ("llama3", "longrope"):
        c["rope_scaling"]["rope_type"] = kind
        (tmp_path / "config.json").write_text(json.dumps(c))
        assert main(["plan", "--model", str(tmp_path / "config.json"), "--gpus", "8", "--global-batch", "8",
                     "--seq-len", "64", "--top", "1"]) == 0
        assert "not supported" not in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["llama3", "yarn", "yarn-mscale", "linear"])
def test_export_writes_rope_scaling_for_readers_of_transformers_4s_key(tmp_path, kind):
    """A transformers 4.x reader (and serving engines) looks only at the flat ``rope_theta`` and
    ``rope_scaling``: the exported file, with ``rope_parameters`` removed (what such a reader
    sees), loaded through transformers' reading of ``rope_scaling`` gives the source model's
    logits, bitwise; an unscaled model writes ``rope_scaling: null`` (4.x's default)."""
    hf = make_hf(tmp_path / "hf", ROPES[kind])
    model = ours(tmp_path / "hf")
    save_hf(model.state_dict(), model.cfg, tmp_path / "out")
    c = json.loads((tmp_path / "out" / "config.json").read_text())
    assert c["rope_scaling"]["rope_type"] == kind.split("-")[0] and c["rope_scaling"]["factor"] == ROPES[kind]["factor"]
    del c["rope_parameters"]
    (tmp_path / "out" / "config.json").write_text(json.dumps(c))
    old_reader = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    x = tokens(40)
    with torch.no_grad():
        assert torch.equal(old_reader(input_ids=x).logits, hf(input_ids=x).logits)
    plain = Llama(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=64))
    save_hf(plain.state_dict(), plain.cfg, tmp_path / "plain")
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["rope_scaling"] is None
