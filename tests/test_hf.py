"""Hugging Face weights in and out: tiny random ``LlamaForCausalLM`` models saved locally."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from layouts import make_trainer
from safetensors.torch import load_file, save_file

from hybridpar.cli import main
from hybridpar.config import Config, ConfigError, load_config
from hybridpar.data.tokenizer import BPETokenizer, ByteTokenizer
from hybridpar.models.hf import (
    HFError,
    load_hf_state_dict,
    model_config_from_hf,
    save_hf,
)
from hybridpar.models.llama import Llama
from hybridpar.models.llama.hf import hf_key

transformers = pytest.importorskip("transformers")

# The HF shape and the matching hybridpar overrides (vocab 256 = the byte-level data).
HF_SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
MODEL_ARGS = ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
              "--model.ffn_hidden", "64", "--model.vocab_size", "256", "--model.max_seq_len", "64"]
TRAIN_ARGS = ["--train.seq_len", "32", "--train.global_batch", "4", "--train.micro_batch", "2",
              "--train.log_every", "1", "--train.eval_every", "0", "--train.sample_tokens", "8"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def make_hf(path, seed: int = 0, shard: str | None = None, **overrides):
    """A random HF Llama (norm scales randomized too) saved with save_pretrained into ``path``."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**HF_SHAPE, **overrides})).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kw)
    return model.eval()


def tokens(vocab: int = 256, shape=(2, 16)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("kind", "overrides", "shard"), [
    ("gqa-untied", {}, None),
    ("gqa-untied-sharded", {}, "40KB"),
    ("mha-tied", dict(num_key_value_heads=4, tie_word_embeddings=True, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), None),
])
def test_load_hf_matches_hf_logits(tmp_path, kind, overrides, shard):
    hf = make_hf(tmp_path, shard=shard, **overrides)
    files = {p.name for p in tmp_path.iterdir()}
    assert ("model.safetensors.index.json" in files) == bool(shard), files
    cfg = model_config_from_hf(tmp_path)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden, cfg.vocab_size, cfg.max_seq_len) == (
        32, 2, 4, overrides.get("num_key_value_heads", 2), 64, 256, 64)
    assert cfg.tie_embeddings == overrides.get("tie_word_embeddings", False)
    assert cfg.rope_theta == (500000.0 if "rope_parameters" in overrides else 10000.0)
    assert cfg.norm_eps == overrides.get("rms_norm_eps", 1e-5)
    ours = Llama(cfg)
    ours.load_state_dict(load_hf_state_dict(tmp_path), strict=True)
    x = tokens()
    with torch.no_grad():
        err = rel_err(ours(x), hf(input_ids=x).logits)
    print(f"{kind}: HF -> hybridpar logits rel err {err:.2e}")
    assert err <= 1e-5


def test_legacy_flat_rope_theta_and_tied_head_present(tmp_path):
    """transformers 4.x style config (flat rope_theta, rope_scaling null); a tied lm_head stored
    explicitly (equal to the embedding) is accepted and dropped."""
    make_hf(tmp_path, num_key_value_heads=4, tie_word_embeddings=True)
    c = json.loads((tmp_path / "config.json").read_text())
    c.pop("rope_parameters", None)
    c.pop("head_dim", None)
    c.update(rope_theta=123456.0, rope_scaling=None)
    (tmp_path / "config.json").write_text(json.dumps(c))
    w = load_file(tmp_path / "model.safetensors")
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()
    save_file(w, tmp_path / "model.safetensors")
    cfg = model_config_from_hf(tmp_path)
    assert cfg.rope_theta == 123456.0 and cfg.tie_embeddings
    assert "output.weight" not in load_hf_state_dict(tmp_path)
    w["lm_head.weight"] = w["lm_head.weight"] + 1
    save_file(w, tmp_path / "model.safetensors")
    with pytest.raises(HFError, match="lm_head.weight differs"):
        load_hf_state_dict(tmp_path)


@pytest.mark.parametrize("tied", [False, True])
def test_save_hf_loads_in_transformers(tmp_path, tied):
    cfg = load_config(None, [*MODEL_ARGS, *TRAIN_ARGS, "--model.tie_embeddings", str(tied)]).model
    ours = Llama(cfg)
    ours.init_weights(3)
    out = save_hf(ours.state_dict(), cfg, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temp dir cleaned up
    stored = load_file(out / "model.safetensors")
    assert ("lm_head.weight" in stored) != tied and all(t.dtype == torch.float32 for t in stored.values())
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert hf.config.tie_word_embeddings == tied
    x = tokens()
    with torch.no_grad():
        err = rel_err(hf(input_ids=x).logits, ours(x))
    print(f"tied={tied}: hybridpar -> HF logits rel err {err:.2e}")
    assert err <= 1e-5
    assert model_config_from_hf(out).dim == cfg.dim  # and our own loader reads it back

    with pytest.raises(FileExistsError, match="--overwrite"):
        save_hf(ours.state_dict(), cfg, out)
    ours.init_weights(4)
    save_hf(ours.state_dict(), cfg, out, overwrite=True)
    assert torch.equal(load_file(out / "model.safetensors")["model.norm.weight"], ours.norm.weight.detach())
    assert torch.equal(load_file(out / "model.safetensors")[hf_key("layers.1.attention.wk.weight")],
                       ours.layers[1].attention.wk.weight.detach())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_trainer_init_from_hf(tmp_path):
    hf = make_hf(tmp_path / "hf")
    cfg = load_config(None, [*MODEL_ARGS, *TRAIN_ARGS, "--train.init_from", str(tmp_path / "hf"),
                             "--train.run_dir", str(tmp_path / "run"), "--train.steps", "1"])
    trainer = make_trainer(cfg)
    ref = dict(hf.named_parameters())
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, ref[hf_key(name)]), name
    with torch.no_grad():
        batches = trainer.micro_batches(1, cfg.train.global_batch, trainer.train_data)
        hf_loss = torch.stack([F.cross_entropy(hf(input_ids=x).logits.flatten(0, 1), y.flatten())
                               for x, y in batches]).mean().item()
    # the same through the command line: the step-1 loss is the HF model's loss on that batch
    run = tmp_path / "run_cli"
    assert main(["train", *MODEL_ARGS, *TRAIN_ARGS, "--train.init_from", str(tmp_path / "hf"),
                 "--train.run_dir", str(run), "--train.steps", "2"]) == 0
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    print(f"step-1 loss {first['loss']:.6f} vs HF {hf_loss:.6f}")
    assert first["step"] == 1 and first["loss"] == pytest.approx(hf_loss, rel=1e-5)


def test_trainer_rejects_other_shape(tmp_path):
    make_hf(tmp_path / "hf")
    args = [a if a != "64" else "96" for a in MODEL_ARGS]  # ffn_hidden and max_seq_len differ
    cfg = load_config(None, [*args, *TRAIN_ARGS, "--train.init_from", str(tmp_path / "hf"),
                             "--train.run_dir", str(tmp_path / "run")])
    with pytest.raises(ValueError, match="model.ffn_hidden = 96 in the config but 64") as e:
        make_trainer(cfg)
    msg = str(e.value)
    assert "model.max_seq_len = 96" in msg and "--model.ffn_hidden 64 --model.max_seq_len 64" in msg
    assert "model.dim" not in msg and "--model.preset" in msg


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 5e5, "factor": 8.0}, "rope_parameters = "),
    ("rope_scaling", {"type": "su", "factor": 2.0}, 'rope_scaling = {"type": "su"'),
    ("attention_bias", True, "attention_bias = true"),
    ("mlp_bias", True, "mlp_bias = true"),
    ("hidden_act", "gelu", 'hidden_act = "gelu"'),
    ("model_type", "falcon", 'model_type = "falcon"'),
    ("attention_dropout", 0.1, "attention_dropout = 0.1"),
])
def test_unsupported_config_is_named(tmp_path, key, value, needle):
    make_hf(tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    c[key] = value
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(HFError, match="not supported") as e:
        model_config_from_hf(tmp_path)
    assert needle in str(e.value)


def test_weight_errors_name_the_key(tmp_path):
    with pytest.raises(HFError, match="config.json' does not exist"):
        model_config_from_hf(tmp_path)
    make_hf(tmp_path)
    w = load_file(tmp_path / "model.safetensors")
    key = "model.layers.1.self_attn.k_proj.weight"
    save_file({k: v for k, v in w.items() if k != key}, tmp_path / "model.safetensors")
    with pytest.raises(HFError, match=f"tensor '{key}' is missing"):
        load_hf_state_dict(tmp_path)
    save_file({**w, key: w[key][:4].clone()}, tmp_path / "model.safetensors")
    with pytest.raises(HFError, match=rf"'{key}' has shape \[4, 32\], the config needs \[16, 32\]"):
        load_hf_state_dict(tmp_path)
    save_file({**w, "model.layers.1.self_attn.q_proj.bias": torch.zeros(32)}, tmp_path / "model.safetensors")
    with pytest.raises(HFError, match="unexpected tensor 'model.layers.1.self_attn.q_proj.bias'"):
        load_hf_state_dict(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(HFError, match="neither model.safetensors"):
        load_hf_state_dict(tmp_path)


def test_convert_cli(tmp_path, monkeypatch, capsys):
    """``hybridpar convert`` wiring, with ``load_model_state`` stubbed (see the test below for
    the real checkpoint path)."""
    cfg = load_config(None, [*MODEL_ARGS, *TRAIN_ARGS])
    ours = Llama(cfg.model)
    ours.init_weights(5)
    fake = types.ModuleType("hybridpar.training.checkpoint")
    fake.load_model_state = lambda path: (cfg, ours.state_dict())
    fake.load_tokenizer_of = lambda path: ByteTokenizer()
    monkeypatch.setitem(sys.modules, "hybridpar.training.checkpoint", fake)
    (tmp_path / "ckpt").mkdir()
    out = tmp_path / "hf"
    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(out)]) == 0
    assert "with its bytes tokenizer (vocab 256)" in capsys.readouterr().out
    assert transformers.AutoTokenizer.from_pretrained(out)("héllo")["input_ids"] == list("héllo".encode())
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert rel_err(hf(input_ids=tokens()).logits, ours(tokens())) <= 1e-5
    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(out), "--overwrite"]) == 0
    assert main(["convert", str(tmp_path / "nope"), "--to-hf", str(out)]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_convert_real_checkpoint(tmp_path):
    """A trained checkpoint converts to a directory transformers loads with the same logits."""
    from hybridpar.training import checkpoint as ckpt

    run = tmp_path / "run"
    assert main(["train", *MODEL_ARGS, *TRAIN_ARGS, "--train.steps", "1", "--train.run_dir", str(run)]) == 0
    path = ckpt.latest_checkpoint(run)
    assert path is not None, f"no complete checkpoint under {run}"
    cfg, state = ckpt.load_model_state(path)
    assert isinstance(cfg, Config)
    assert main(["convert", str(path), "--to-hf", str(tmp_path / "hf")]) == 0
    assert_same_tokenizer(transformers.AutoTokenizer.from_pretrained(tmp_path / "hf"), ckpt.load_tokenizer_of(path))
    ours = Llama(cfg.model)
    ours.load_state_dict(state, strict=True)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert rel_err(hf(input_ids=tokens()).logits, ours(tokens())) <= 1e-5


def test_config_error_is_a_config_error():
    assert issubclass(HFError, ConfigError)


TEXTS = ["hello world", "  two  spaces\tand a tab\n\nnew paragraph ", "héllo naïve données π", "日本語 🤖 ß",
         "\x00\x01 control\x7f", ""]


def assert_same_tokenizer(hf_tok, ours) -> None:
    """transformers' tokenizer encodes (without added tokens) and decodes exactly like ours."""
    assert len(hf_tok) == ours.vocab_size
    for text in TEXTS:
        ids = ours.encode(text)
        assert hf_tok(text)["input_ids"] == hf_tok.encode(text) == ids, text
        assert hf_tok.decode(ids) == ours.decode(ids) == text, text


def train_bpe() -> BPETokenizer:
    words = ["def", "return", "self", "héllo", "naïve", "données", "π", "tensor", " ", "\n"]
    return BPETokenizer.train(iter([" ".join(words[(i * 7 + j) % len(words)] for j in range(50))
                                    for i in range(20)]), 300)


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_exported_tokenizer_loads_in_transformers(tmp_path, kind):
    """``save_hf(..., tokenizer=...)`` (what ``hybridpar convert`` calls with the checkpoint's
    tokenizer) writes tokenizer.json + tokenizer_config.json that AutoTokenizer loads beside the
    Llama config.json (so not as LlamaTokenizer, which would add a BOS token) and that encodes
    every text to the ids ours gives; nothing is downloaded."""
    ours = ByteTokenizer() if kind == "bytes" else train_bpe()
    cfg = load_config(None, [*MODEL_ARGS, *TRAIN_ARGS]).model
    model = Llama(cfg)
    model.init_weights(0)
    out = save_hf(model.state_dict(), cfg, tmp_path / "hf", tokenizer=ours)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.model_max_length == cfg.max_seq_len
    assert_same_tokenizer(hf_tok, ours)
    if kind == "bytes":  # one id per UTF-8 byte, the whole byte range included
        every_byte = bytes(range(256)).decode("latin-1")
        assert hf_tok(every_byte)["input_ids"] == list(every_byte.encode())
        assert sorted(hf_tok.get_vocab().values()) == list(range(256))
        assert hf_tok.decode(list(b"ab\xff\xfecd")) == ours.decode(list(b"ab\xff\xfecd"))  # invalid UTF-8
