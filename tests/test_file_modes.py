"""What hybridpar publishes gets the modes a plain open()/mkdir() would (0o666 / 0o777 less the
umask), not the private modes of the temporary files and directories it is built in: a prepared
dataset, an exported Hugging Face model and a file written by atomic_write_text."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hybridpar.config import load_config
from hybridpar.data.prepare import prepare_dataset
from hybridpar.data.tokenizer import ByteTokenizer
from hybridpar.fsutil import atomic_write_text, current_umask
from hybridpar.models.hf import save_hf
from hybridpar.models.llama import Llama
from hybridpar.training.metrics import atomic_write_text as metrics_atomic_write_text

MODEL_ARGS = ["--model.dim", "32", "--model.n_layers", "1", "--model.n_heads", "4", "--model.n_kv_heads", "2",
              "--model.ffn_hidden", "64", "--model.vocab_size", "256", "--model.max_seq_len", "64", "--train.seq_len", "32"]


@pytest.fixture(params=[0o022, 0o077], ids=["umask022", "umask077"])
def umask(request):
    old = os.umask(request.param)
    try:
        assert current_umask() == request.param
        yield request.param
    finally:
        os.umask(old)


def modes(root: Path) -> dict[str, int]:
    """Permission bits of ``root`` and everything below it, by relative path."""
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    for p in sorted(root.rglob("*")):
        out[p.relative_to(root).as_posix()] = stat.S_IMODE(p.stat().st_mode)
    return out


def expect(root: Path, mask: int) -> dict[str, int]:
    return {name: (0o777 if name == "." or (root / name).is_dir() else 0o666) & ~mask for name in modes(root)}


def test_prepared_dataset_is_readable_as_the_umask_allows(tmp_path, umask):
    text = tmp_path / "text"
    text.mkdir()
    for i in range(3):
        (text / f"d{i}.txt").write_text(f"some text number {i} " * 20)
    out = tmp_path / "ds"
    prepare_dataset([text], out, tokenizer="bpe", vocab_size=280, val_fraction=0.34)
    got = modes(out)
    assert {"meta.json", "tokenizer.json", "train-00000.bin", "val-00000.bin"} <= set(got)
    assert got == expect(out, umask)
    readable = all(m & 0o044 == 0o044 for m in got.values())
    assert readable == (umask == 0o022)


def test_exported_model_is_readable_as_the_umask_allows(tmp_path, umask):
    cfg = load_config(None, MODEL_ARGS)
    model = Llama(cfg.model)
    model.init_weights(0)
    out = save_hf(model.state_dict(), cfg.model, tmp_path / "hf", tokenizer=ByteTokenizer())
    got = modes(out)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(got)
    assert got == expect(out, umask)  # safetensors writes 0600 on its own
    assert all(m & 0o044 == 0o044 for m in got.values()) == (umask == 0o022)


def test_atomic_write_text_is_readable_as_the_umask_allows(tmp_path, umask):
    assert metrics_atomic_write_text is atomic_write_text  # its users import it from training.metrics
    path = tmp_path / "summary.json"
    path.write_text("old")
    os.chmod(path, 0o600)  # a replaced file does not pass its mode on
    atomic_write_text(path, "{}\n")
    assert path.read_text() == "{}\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary left behind
