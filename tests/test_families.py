"""Qwen2, Qwen3 and Mistral (issue 17): tiny random ``transformers`` models (nothing downloaded)
imported with the right family and shape and the same logits, exported back, and trained under
tp / SP / pp / cp / ZeRO-3 / 3D layouts exactly like one process.

Each family is built to exercise what it adds to Llama's math: Qwen2 its q/k/v biases (here
also tied embeddings and an odd vocabulary, padded under tp), Qwen3 its per-head q/k RMSNorms
(summed over tp) and a head size other than hidden / heads, Mistral Llama's names under its
own ``model_type`` (with a sliding window wider than the context, which changes nothing).
Norm scales and biases are randomized so that a wrong mapping or a wrong norm cannot hide.
The layout tolerances are :mod:`test_layouts`' (losses 1e-5 relative, weights 1% of lr x steps).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import test_layouts
import torch
import torch.nn.functional as F
from layouts import Run, Trained, assert_trains_like, train_layout, train_one_thread
from safetensors.torch import load_file

from hybridpar.cli import main
from hybridpar.config import ConfigError, load_config
from hybridpar.models.hf import (
    HFError,
    check_same_shape,
    init_from_hf,
    load_hf_state_dict,
    model_config_from_hf,
    save_hf,
)
from hybridpar.models.registry import FAMILIES, family_of
from hybridpar.training.trainer import Trainer

pytestmark = pytest.mark.numerics  # layout equality: also run under other ATEN_CPU_CAPABILITY (Makefile)

COMMON = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
# family -> (transformers class prefix, config kwargs, the ModelConfig fields they must give)
SPECS = {
    "qwen2": ("Qwen2", dict(hidden_size=32, intermediate_size=64, vocab_size=257, tie_word_embeddings=True,
                            rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
              dict(dim=32, ffn_hidden=64, vocab_size=257, head_dim=8, tie_embeddings=True, norm_eps=1e-6,
                   rope_theta=1e6, qkv_bias=True, qk_norm=False)),
    "qwen3": ("Qwen3", dict(hidden_size=32, head_dim=16, intermediate_size=48, vocab_size=256,
                            rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
              dict(dim=32, ffn_hidden=48, vocab_size=256, head_dim=16, tie_embeddings=False, norm_eps=1e-6,
                   rope_theta=1e6, qkv_bias=False, qk_norm=True)),
    "mistral": ("Mistral", dict(hidden_size=32, intermediate_size=96, vocab_size=260, rms_norm_eps=1e-5,
                                sliding_window=4096),
                dict(dim=32, ffn_hidden=96, vocab_size=260, head_dim=8, tie_embeddings=False, norm_eps=1e-5,
                     rope_theta=10000.0, qkv_bias=False, qk_norm=False)),
    # Llama's import is covered by test_hf/test_llama; here only its parallel logits (below)
    "llama": ("Llama", dict(hidden_size=32, intermediate_size=64, vocab_size=256, rms_norm_eps=1e-5),
              dict(dim=32, ffn_hidden=64, vocab_size=256, head_dim=8, tie_embeddings=False, norm_eps=1e-5,
                   rope_theta=10000.0, qkv_bias=False, qk_norm=False)),
}
NAMES = ["qwen2", "qwen3", "mistral"]
PARALLEL_IMPORTS = [(name, layout) for name in NAMES for layout in ("cp2", "pp2")] + [
    ("llama", layout) for layout in ("tp2", "tp2-sp", "cp2", "pp2")]


def hf_lib():
    """``transformers``, imported only where a test needs it (not in the gloo workers, which
    import this module to run :func:`_imported`); skips the test without it."""
    return pytest.importorskip("transformers")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (as in test_hf / test_llama)."""
    return ((a - b).abs().max() / b.abs().max()).item()


def hf_config(name: str, **overrides):
    prefix, kwargs, _ = SPECS[name]
    return getattr(hf_lib(), f"{prefix}Config")(**{**COMMON, **kwargs, **overrides})


@torch.no_grad()
def make_hf(name: str, path: Path, seed: int = 0):
    """A random ``*ForCausalLM`` of family ``name`` (norm scales and biases randomized too),
    saved with ``save_pretrained`` into ``path``; returned in eval mode."""
    prefix = SPECS[name][0]
    torch.manual_seed(seed)
    model = getattr(hf_lib(), f"{prefix}ForCausalLM")(hf_config(name)).float()
    for key, p in model.named_parameters():
        if "norm" in key:
            p.uniform_(0.5, 1.5)
        elif key.endswith(".bias"):
            p.uniform_(-0.2, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


@functools.cache
def hf_dir(name: str, base: str) -> str:
    """The saved HF model of family ``name`` under ``base`` (made once per session)."""
    path = Path(base) / f"hf-{name}"
    if not path.exists():
        make_hf(name, path)
    return str(path)


def tokens(vocab: int, shape=(2, 24)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1))


def base(tmp_path_factory) -> str:
    return str(tmp_path_factory.getbasetemp())


# ----------------------------------------------------------------------------- import, export


@pytest.mark.parametrize("name", NAMES)
def test_import_matches_transformers(name, tmp_path):
    hf = make_hf(name, tmp_path)
    cfg = model_config_from_hf(tmp_path)
    expected = SPECS[name][2]
    assert cfg.family == name and family_of(cfg) is FAMILIES[name]
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.max_seq_len) == (2, 4, 2, 64)
    assert {k: getattr(cfg, k) for k in expected} == expected
    ours = family_of(cfg).build(cfg)
    init_from_hf(ours, tmp_path)
    n_ours = sum(p.numel() for p in ours.parameters())
    n_hf = sum(p.numel() for p in hf.parameters())  # a tied head counts once
    assert cfg.num_params() == n_ours == n_hf, (cfg.num_params(), n_ours, n_hf)
    x = tokens(cfg.vocab_size)
    with torch.no_grad():
        err = rel_err(ours(x), hf(input_ids=x).logits)
    print(f"{name}: transformers -> hybridpar logits rel err {err:.2e}")
    assert err <= 1e-5


@torch.no_grad()
def _randomize_norms_and_biases(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for key, p in model.named_parameters():
        if "norm" in key:
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        elif key.endswith(".bias"):
            p.copy_(torch.rand(p.shape, generator=gen) * 0.4 - 0.2)


@pytest.mark.parametrize("name", NAMES)
def test_export_reloads_in_transformers(name, tmp_path, tmp_path_factory):
    cfg = model_config_from_hf(hf_dir(name, base(tmp_path_factory)))
    family = family_of(cfg)
    ours = family.build(cfg)
    ours.init_weights(3)
    _randomize_norms_and_biases(ours, 3)
    out = save_hf(ours.state_dict(), cfg, tmp_path / "hf")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == name and written["architectures"] == [family.hf.architecture]
    hf = hf_lib().AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == family.hf.architecture and hf.config.model_type == name
    assert hf.config.tie_word_embeddings == cfg.tie_embeddings
    assert sum(p.numel() for p in hf.parameters()) == cfg.num_params()
    x = tokens(cfg.vocab_size)
    with torch.no_grad():
        err = rel_err(hf(input_ids=x).logits, ours(x))
    print(f"{name}: hybridpar -> transformers logits rel err {err:.2e}")
    assert err <= 1e-5
    # and back: same config (family, shape, features), the very same tensors
    check_same_shape(model_config_from_hf(out), cfg, str(out))
    back = load_hf_state_dict(out)
    assert back.keys() == ours.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())
    assert ("lm_head.weight" in load_file(out / "model.safetensors")) != cfg.tie_embeddings


# ----------------------------------------------------------------------------- layouts

# test_layouts' steps, learning rate, weight tolerance rule (see its docstring) and layouts, plus
# the few this matrix adds.
STEPS, LR, WEIGHT_ATOL = test_layouts.STEPS, test_layouts.LR, test_layouts.WEIGHT_ATOL
TRAIN = ["--train.seq_len", "32", "--train.global_batch", "8", "--train.micro_batch", "2",
         "--train.warmup_steps", "2", "--train.eval_batches", "1", "--train.sample_tokens", "16",
         "--train.lr", str(LR)]

LAYOUTS = {
    **{name: test_layouts.LAYOUTS[name] for name in ("tp2", "tp2-sp", "pp2", "cp2", "dp2-zero3", "dp2-tp2-pp2")},
    "dp2-tp2-zero1": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.zero_stage", "1"],
    "dp2-tp2-sp-zero3": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.sequence_parallel", "true",
                         "--parallel.zero_stage", "3"],
    "tp2-pp2-cp2": ["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.cp", "2"],
}
# Every family under the six kinds (2 ranks each) and one 3D layout; Qwen3's per-head norms,
# whose gradients are partial sums over tp, also under tp x ZeRO. Ordered by world size, so the
# worker pool restarts as seldom as possible.
CASES = ([(n, lay) for lay in ("tp2", "tp2-sp", "pp2", "cp2", "dp2-zero3") for n in NAMES]
         + [("qwen3", "dp2-tp2-zero1"), ("qwen3", "dp2-tp2-sp-zero3"), ("qwen2", "dp2-tp2-zero1")]
         + [("qwen3", "dp2-tp2-pp2"), ("qwen2", "tp2-pp2-cp2"), ("mistral", "dp2-tp2-pp2")])


def imported_run(hf: str, run_dir: str, layout: list[str] | tuple[str, ...] = ()) -> Run:
    """The run of ``layout``: model (family and shape) from ``hf``'s config.json, as the CLI does."""
    return Run(run_dir, ("--train.init_from", hf, *layout), STEPS, base=tuple(TRAIN), lr=None,
               init_model=model_config_from_hf, before=_imported)


def _imported(trainer: Trainer) -> dict:
    """Before training: the imported model's logits (tp-gathered; where no pp, cp or ZeRO
    shards them) and, in one process, step 1's batch and the initial weights."""
    from hybridpar.parallel.tensor import gather_logits

    cfg, topo = trainer.cfg, trainer.topo
    p = cfg.parallel
    out: dict = {"logits": None}
    if p.pp == p.cp == 1 and p.zero_stage == 0:
        with torch.no_grad():
            out["logits"] = gather_logits(trainer.model(tokens(cfg.model.vocab_size, (2, 32))), topo.tp,
                                          cfg.model.vocab_size)
    if topo.world_size == 1:
        out["batch"] = trainer.micro_batches(1, cfg.train.global_batch, trainer.train_data)
        out["init"] = trainer.engine.full_state_dict()
    return out


@functools.cache
def reference(name: str, base_dir: str) -> Trained:
    """One process: losses, final weights, logits; and transformers' logits and its loss on
    step 1's batch."""
    hf = hf_dir(name, base_dir)
    ref = train_one_thread(imported_run(hf, str(Path(base_dir) / f"run-{name}-one")))
    model = hf_lib().AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        ref.extra["hf_loss"] = torch.stack([F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
                                            for x, y in ref.extra["batch"]]).mean().item()
        ref.extra["hf_logits"] = model(input_ids=tokens(model.config.vocab_size, (2, 32))).logits
    return ref


@pytest.mark.parametrize(("name", "layout"), CASES, ids=[f"{n}-{lay}" for n, lay in CASES])
def test_imported_model_trains_like_one_process(name, layout, tmp_path, tmp_path_factory):
    ref = reference(name, base(tmp_path_factory))
    # the single process itself is transformers' model: logits and the step-1 loss on its batch
    assert rel_err(ref.extra["logits"], ref.extra["hf_logits"]) <= 1e-5
    assert ref.losses[0] == pytest.approx(ref.extra["hf_loss"], rel=1e-5)
    results = train_layout(imported_run(hf_dir(name, base(tmp_path_factory)), str(tmp_path), LAYOUTS[layout]))
    for rank, r in enumerate(results):
        if r.extra["logits"] is not None:
            assert rel_err(r.extra["logits"], ref.extra["hf_logits"]) <= 1e-5, f"rank {rank}"
    norms = ("q_norm.weight", "k_norm.weight")  # per-head norms first
    assert_trains_like(results, ref, atol=WEIGHT_ATOL, same_keys=True, first=norms)
    if name == "qwen3":  # the per-head norms did train (their equality above means something)
        for k in (k for k in results[0].state if k.endswith(norms)):
            moved = (ref.state[k] - ref.extra["init"][k]).abs().max().item()
            assert moved > 20 * WEIGHT_ATOL, f"{k} moved only {moved:.2e} in {STEPS} steps"


@pytest.mark.parametrize(("name", "layout"), PARALLEL_IMPORTS)
def test_import_matches_transformers_at_cp2_and_pp2(name, layout, dist_run, tmp_path_factory):
    """The imported model's own logits under ring attention (cp2) and across two pipeline stages
    (pp2), plain and with packed documents, equal transformers' (each document run on its own);
    Llama's at tp2 and tp2+SP too (the others' tp logits are checked in
    test_imported_model_trains_like_one_process). The worker is test_gpt2's: it knows no family
    (Engine + --train.init_from)."""
    import test_gpt2 as g

    path = tmp_path_factory.mktemp(f"{name}-{layout}")
    hf = make_hf(name, path)
    x = g.tokens()
    with torch.no_grad():
        expected = {"plain": hf(input_ids=x).logits, "docs": g.hf_document_logits(hf, x, g.SEGMENTS)}
    checked = 0
    for rank, r in enumerate(dist_run(2, g._hf_logits, str(path), g.HF_LAYOUTS[layout])):
        for kind in ("plain", "docs"):
            if r[kind] is not None:  # pp: only the last stage holds logits
                assert rel_err(r[kind], expected[kind]) <= 1e-5, (rank, kind)
                checked += 1
    assert checked >= 2


def test_init_from_run_resumes_and_converts_back(tmp_path, tmp_path_factory):
    """A run started from a Qwen3 directory: its checkpoint resumes, and converts to a directory
    transformers loads (Qwen3ForCausalLM, head_dim kept) with the checkpoint's logits."""
    from hybridpar.training import checkpoint

    hf = hf_dir("qwen3", base(tmp_path_factory))
    run = ["train", *TRAIN, "--train.init_from", hf, "--train.run_dir", str(tmp_path / "run"),
           "--train.eval_every", "0", "--train.sample_tokens", "4"]
    assert main([*run, "--train.steps", "1"]) == 0
    ckpt = checkpoint.latest_checkpoint(tmp_path / "run")
    assert main(["convert", str(ckpt), "--to-hf", str(tmp_path / "out")]) == 0
    cfg, state = checkpoint.load_model_state(ckpt)
    assert cfg.model.family == "qwen3" and cfg.model.kv_channels == 16
    ours = family_of(cfg.model).build(cfg.model)
    ours.load_state_dict(state, strict=True)
    exported = hf_lib().AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(exported).__name__ == "Qwen3ForCausalLM" and exported.config.head_dim == 16
    x = tokens(cfg.model.vocab_size)
    with torch.no_grad():
        assert rel_err(exported(input_ids=x).logits, ours(x)) <= 1e-5
    assert main([*run, "--train.steps", "2", "--resume"]) == 0


# ----------------------------------------------------------------------------- bad input


def one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("use_sliding_window", [None, False])  # Mistral has no such switch: refused either way
def test_mistral_sliding_window_narrower_than_context_is_refused(tmp_path, use_sliding_window, capsys):
    hf_config("mistral", sliding_window=16).save_pretrained(tmp_path)
    if use_sliding_window is not None:  # what the old message advised
        c = json.loads((tmp_path / "config.json").read_text())
        c["use_sliding_window"] = use_sliding_window
        (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(HFError) as e:
        model_config_from_hf(tmp_path)
    msg = one_line_error(e)
    assert "sliding_window = 16 is not supported" in msg, msg
    assert "whole causal context" in msg and "max_position_embeddings = 64" in msg, msg
    # the same one line from the command line, before anything is built
    assert main(["train", "--train.init_from", str(tmp_path), "--train.run_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"hybridpar: error: {msg}"


@pytest.mark.parametrize(("name", "keys", "ok"), [
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), False),
    ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), False),
    ("qwen2", dict(use_sliding_window=False, sliding_window=16), True),  # transformers ignores the window
    ("qwen3", dict(use_sliding_window=False, sliding_window=16), True),
    ("mistral", dict(sliding_window=None), True),
    ("mistral", dict(sliding_window=64), True),  # as wide as the context: full causal attention
])
def test_sliding_window_rule(tmp_path, name, keys, ok):
    """A window narrower than the context is refused where transformers would use it (keys set
    in config.json as a published model states them)."""
    hf_config(name).save_pretrained(tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**c, **keys}))
    if ok:
        assert model_config_from_hf(tmp_path).family == name
        return
    with pytest.raises(HFError, match="sliding_window = 16 is not supported") as e:
        model_config_from_hf(tmp_path)
    one_line_error(e)


def test_init_from_contradicting_model_key_is_refused(tmp_path_factory):
    hf = hf_dir("qwen3", base(tmp_path_factory))
    args = [*TRAIN, "--train.init_from", hf]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*args, "--model.dim", "64"], init_model=model_config_from_hf)
    msg = one_line_error(e)
    assert "model.dim = 64 was given" in msg and f"{hf} has 32" in msg, msg
    # an explicit key that agrees is fine; the family and Qwen3's features come from the directory
    cfg = load_config(None, [*args, "--model.dim", "32"], init_model=model_config_from_hf).model
    assert (cfg.family, cfg.qk_norm, cfg.kv_channels, cfg.dim) == ("qwen3", True, 16, 32)
    with pytest.raises(ConfigError, match="model.family = 'llama' was given but .* has 'qwen3'"):
        load_config(None, [*args, "--model.family", "llama"], init_model=model_config_from_hf)


def test_unsupported_model_type_lists_the_supported(tmp_path):
    hf_config("qwen2").save_pretrained(tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    c["model_type"] = "falcon"
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(HFError) as e:
        model_config_from_hf(tmp_path)
    msg = one_line_error(e)
    assert 'model_type = "falcon" is not supported' in msg, msg
    assert msg.endswith(f"supported: {', '.join(sorted(FAMILIES))}"), msg
    assert {"llama", "qwen2", "qwen3", "mistral"} <= set(msg.rpartition("supported: ")[2].split(", "))
