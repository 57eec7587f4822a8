"""The data pipeline: prepare (bytes and BPE), the on-disk format, verified loading, the builtin
cache, one-line errors, atomicity, and training on a prepared dataset through the CLI."""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import hybridpar.data.corpus as corpus
import hybridpar.data.prepare as prep
from hybridpar.cli import main
from hybridpar.data.corpus import WindowSampler, load_builtin, load_tokens
from hybridpar.data.dataset import check_seq_len, load_dataset
from hybridpar.data.errors import (
    DataError,
    DataNotFoundError,
    DatasetExistsError,
    SplitTooShortError,
)
from hybridpar.data.prepare import prepare_dataset
from hybridpar.data.tokenizer import BPETokenizer
from hybridpar.errors import UserError

WORDS = ["def", "return", "self", "value", "print", "import", "numpy", "tensor", "grad", "héllo", "naïve",
         "données", "loss", "step", "train", "model", "layer", "shard", "token", "π"]


def make_corpus(root: Path, n_files: int = 6, words: int = 200, seed: int = 0) -> list[Path]:
    rng = random.Random(seed)
    files = []
    for i in range(n_files):
        path = root / ("sub" if i % 2 else "") / f"doc{i:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(words // 10)]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


@pytest.fixture
def text_dir(tmp_path) -> Path:
    make_corpus(tmp_path / "text")
    return tmp_path / "text"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_prepare_bytes_writes_the_format_and_reloads_the_tokens(tmp_path, text_dir):
    files = prep.expand_inputs([text_dir])
    assert [p.relative_to(text_dir).as_posix() for p in files] == sorted(
        p.relative_to(text_dir).as_posix() for p in text_dir.rglob("*.txt"))
    out = tmp_path / "ds"
    meta = prepare_dataset([text_dir], out, val_fraction=0.2)
    assert meta == json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == "bytes" and meta["vocab_size"] == 256 and meta["dtype"] == "uint16"
    assert meta["format_version"] == 1
    assert [s["path"] for s in meta["sources"]] == [str(p) for p in files]
    assert [s["split"] for s in meta["sources"]] == ["train"] * 5 + ["val"]  # int(6 * 0.2) = 1 document
    for split in ("train", "val"):
        entry = meta["splits"][split]
        assert entry["tokens"] == meta["tokens"][split] == sum(s["tokens"] for s in entry["shards"])
        for s in entry["shards"]:
            assert (out / s["file"]).stat().st_size == 2 * s["tokens"] and _sha(out / s["file"]) == s["sha256"]
    data = load_tokens(str(out))
    blob = [p.read_bytes() + b"\n\n" for p in files]
    assert bytes(data.train.astype(np.uint8)) == b"".join(blob[:5])
    assert bytes(data.val.astype(np.uint8)) == blob[5]
    assert isinstance(data.train, np.memmap) and data.train.dtype == np.uint16
    assert data.vocab_size == 256 and data.tokenizer.kind == "bytes" and data.source == str(out)
    assert data.decode(data.encode("héllo π")) == "héllo π"
    x, y = WindowSampler(data.train, 16, seed=0).batch(range(4))  # uint16 memmap -> int64 windows
    assert x.dtype == y.dtype == torch.int64 and x.shape == (4, 16)


def test_prepare_bpe_trains_a_tokenizer_and_reloads_its_output(tmp_path, text_dir):
    out = tmp_path / "bpe"
    meta = prepare_dataset([text_dir], out, tokenizer="bpe", vocab_size=300, val_fraction=0.34)
    assert (out / "tokenizer.json").is_file() and meta["tokenizer"]["sha256"] == _sha(out / "tokenizer.json")
    assert 256 < meta["vocab_size"] <= 300 and meta["dtype"] == "uint16"
    data = load_dataset(out)
    tok = BPETokenizer.from_file(out / "tokenizer.json")
    texts = [p.read_text(encoding="utf-8") + "\n\n" for p in prep.expand_inputs([text_dir])]
    expected = [np.asarray(tok.encode(t)) for t in texts]
    np.testing.assert_array_equal(data.train, np.concatenate(expected[:4]))
    np.testing.assert_array_equal(data.val, np.concatenate(expected[4:]))
    assert len(data.train) < sum(len(t.encode()) for t in texts[:4])  # merges compress
    for text in ("def naïve(x):\n    return π * x  # données\n", "\x00 odd \u2028 bytes 🙂", ""):
        assert data.decode(data.encode(text)) == text
    assert data.decode([*data.encode("π"), 10**6, -1]) == "π"  # ids outside the vocabulary are dropped


def test_shards_roll_over_and_concatenate(tmp_path, text_dir):
    out = tmp_path / "ds"
    meta = prepare_dataset([text_dir], out, shard_tokens=1000, val_fraction=0.2)
    shards = meta["splits"]["train"]["shards"]
    assert [s["file"] for s in shards[:2]] == ["train-00000.bin", "train-00001.bin"]
    assert all(s["tokens"] == 1000 for s in shards[:-1]) and 0 < shards[-1]["tokens"] <= 1000
    prepare_dataset([text_dir], tmp_path / "one", val_fraction=0.2)
    merged = load_dataset(out).train
    assert not isinstance(merged, np.memmap) and merged.dtype == np.uint16
    np.testing.assert_array_equal(merged, load_dataset(tmp_path / "one").train)


def test_a_single_file_is_split_by_tokens(tmp_path, text_dir):
    path = prep.expand_inputs([text_dir])[0]
    meta = prepare_dataset([path], tmp_path / "ds", val_fraction=0.1)
    n = len(path.read_bytes()) + 2
    assert meta["tokens"] == {"train": n - int(n * 0.1), "val": int(n * 0.1)}
    assert meta["sources"][0]["split"] == "train+val"


def test_builtin_is_prepared_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDPAR_CACHE", str(tmp_path / "cache"))
    first = load_builtin(max_bytes=100_000)
    val = np.array(first.val)  # a copy: the memory map would see the damage below
    (cache,) = (tmp_path / "cache").glob("builtin-*")
    stamp = (cache / "meta.json").stat().st_mtime_ns
    assert first.source == "python-stdlib" and first.vocab_size == 256 and len(first.val) > 0

    def no_prepare(*a, **k):
        raise AssertionError("prepared again")

    monkeypatch.setattr(corpus, "prepare_dataset", no_prepare)
    second = load_builtin(max_bytes=100_000)
    assert (cache / "meta.json").stat().st_mtime_ns == stamp
    np.testing.assert_array_equal(second.train, first.train)
    monkeypatch.undo()
    monkeypatch.setenv("HYBRIDPAR_CACHE", str(tmp_path / "cache"))
    with open(cache / "val-00000.bin", "r+b") as f:  # a damaged cache is rebuilt, not trusted
        f.write(b"\xff\xff")
    np.testing.assert_array_equal(load_builtin(max_bytes=100_000).val, val)


# ----------------------------------------------------------------------------- errors


def _unreadable(monkeypatch, target: Path) -> None:
    real = Path.read_bytes

    def read_bytes(self):
        if self == target:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)


@pytest.mark.parametrize("case, needle", [
    ("no_inputs", "no inputs: pass text files"),
    ("missing", "missing.txt' does not exist"),
    ("empty_dir", "no input files found under --input"),
    ("all_empty", "all 2 input files are empty ('"),
    ("unreadable", "cannot read input '"),
    ("not_utf8", "bad.txt' is not UTF-8 text (invalid byte at offset 3)"),
    ("vocab_small", "--vocab-size 100 is too small for bpe"),
    ("vocab_overflow", f"--vocab-size {2**32 + 1} overflows the largest token dtype uint32"),
    ("vocab_bytes", "--vocab-size 1000 does not apply to --tokenizer bytes"),
    ("val_fraction", "--val-fraction 1.5 must be between 0 and 1"),
    ("exists", "exists and is not empty; pass --force"),
])
def test_bad_prepare_input_is_one_line_naming_the_value(tmp_path, text_dir, monkeypatch, case, needle):
    out, kw = tmp_path / "out", {}
    inputs: list = [text_dir]
    if case == "no_inputs":
        inputs = []
    elif case == "missing":
        inputs = [tmp_path / "missing.txt"]
    elif case == "empty_dir":
        (tmp_path / "void").mkdir()
        inputs = [tmp_path / "void"]
    elif case == "all_empty":
        inputs = [tmp_path / "e1.txt", tmp_path / "e2.txt"]
        for p in inputs:
            p.write_text("")
    elif case == "unreadable":
        _unreadable(monkeypatch, prep.expand_inputs([text_dir])[2])
        needle = f"cannot read input {str(prep.expand_inputs([text_dir])[2])!r}: Permission denied"
    elif case == "not_utf8":
        (text_dir / "bad.txt").write_bytes(b"abc\xff\xfe")
        kw = {"tokenizer": "bpe", "vocab_size": 300}
    elif case == "vocab_small":
        kw = {"tokenizer": "bpe", "vocab_size": 100}
    elif case == "vocab_overflow":
        kw = {"tokenizer": "bpe", "vocab_size": 2**32 + 1}
    elif case == "vocab_bytes":
        kw = {"vocab_size": 1000}
    elif case == "val_fraction":
        kw = {"val_fraction": 1.5}
    elif case == "exists":
        out.mkdir()
        (out / "keep.txt").write_text("x")
    with pytest.raises(DataError) as info:
        prepare_dataset(inputs, out, **kw)
    msg = str(info.value)
    assert needle in msg and "\n" not in msg
    assert case == "exists" or not out.exists()
    if case == "missing":
        assert isinstance(info.value, FileNotFoundError)
    if case == "not_utf8":  # the byte tokenizer takes any bytes
        assert prepare_dataset(inputs, out)["tokens"]["val"] > 0


def test_force_replaces_an_existing_dataset(tmp_path, text_dir):
    out = tmp_path / "ds"
    prepare_dataset([text_dir], out)
    with pytest.raises(DatasetExistsError):
        prepare_dataset([text_dir], out, tokenizer="bpe", vocab_size=300)
    prepare_dataset([text_dir], out, tokenizer="bpe", vocab_size=300, force=True)
    assert load_dataset(out).tokenizer.kind == "bpe"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "text"]  # no temporary leftovers


@pytest.mark.parametrize("where", ["shard", "meta"])
def test_interrupted_prepare_leaves_no_dataset(tmp_path, text_dir, monkeypatch, where):
    calls = []

    def boom(*args, **kwargs):
        calls.append(1)
        if where == "meta" or len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    if where == "shard":
        real = prep.ShardWriter.write
        monkeypatch.setattr(prep.ShardWriter, "write", boom)
    else:
        real = prep.write_json
        monkeypatch.setattr(prep, "write_json", boom)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset([text_dir], tmp_path / "ds", shard_tokens=500)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text"]


def test_loading_checks_every_shard(tmp_path, text_dir):
    out = tmp_path / "ds"
    prepare_dataset([text_dir], out, val_fraction=0.2)
    load_dataset(out)  # fine as written
    shard = out / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"shard '.*train-00000.bin' is corrupt or modified: sha256 .* re-run hybridpar prepare"):
        load_dataset(out)
    shard.unlink()
    with pytest.raises(DataNotFoundError, match="train-00000.bin' listed in meta.json is missing"):
        load_dataset(out)


def test_token_ids_beyond_the_vocabulary_are_rejected(tmp_path, text_dir):
    out = tmp_path / "ds"
    prepare_dataset([text_dir], out, val_fraction=0.2)
    meta = json.loads((out / "meta.json").read_text())
    shard = out / "val-00000.bin"
    ids = np.fromfile(shard, dtype="<u2")
    ids[5] = 300
    ids.tofile(shard)
    meta["splits"]["val"]["shards"][0]["sha256"] = _sha(shard)
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="val-00000.bin' holds token id 300 >= vocab_size 256"):
        load_dataset(out)


def test_not_a_prepared_dataset(tmp_path, text_dir):
    with pytest.raises(DataNotFoundError, match=r"not a prepared dataset: '.*text' has no meta.json .*; run hybridpar prepare"):
        load_tokens(str(text_dir))
    with pytest.raises(DataError, match=r"is a file, not a prepared dataset: run hybridpar prepare --input"):
        load_tokens(str(next(text_dir.glob("*.txt"))))
    with pytest.raises(DataNotFoundError, match="'nowhere' does not exist"):
        load_tokens("nowhere")
    out = tmp_path / "ds"
    meta = prepare_dataset([text_dir], out)
    (out / "meta.json").write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(DataError, match="has format version 99, this hybridpar reads version 1"):
        load_dataset(out)


# ----------------------------------------------------------------------------- command line

TINY = [
    "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
    "--model.ffn_hidden", "64", "--model.max_seq_len", "64", "--train.seq_len", "32",
    "--train.global_batch", "4", "--train.micro_batch", "2", "--train.steps", "2",
    "--train.log_every", "1", "--train.eval_every", "2", "--train.eval_batches", "1", "--train.sample_tokens", "8",
]


def test_prepare_and_train_through_the_cli(tmp_path, text_dir, capsys):
    out = tmp_path / "ds"
    assert main(["prepare", "--input", str(text_dir), "--out", str(out), "--tokenizer", "bpe",
                 "--vocab-size", "300", "--val-fraction", "0.34"]) == 0
    assert f"hybridpar: prepared {out}" in capsys.readouterr().out
    vocab = json.loads((out / "meta.json").read_text())["vocab_size"]
    run = tmp_path / "run"
    assert main(["train", *TINY, "--train.data", str(out), "--model.vocab_size", "320",
                 "--train.run_dir", str(run)]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and "val_loss" in records[-1]
    capsys.readouterr()
    assert main(["train", *TINY, "--train.data", str(out), "--train.run_dir", str(tmp_path / "r2")]) == 2
    assert f"data vocabulary {vocab} > model.vocab_size = 256" in capsys.readouterr().err


@pytest.mark.parametrize("args, needle", [
    (["--out", "{tmp}/ds"], "no inputs: pass text files"),
    (["--input", "{tmp}/nope", "--out", "{tmp}/ds"], "nope' does not exist"),
    (["--input", "{text}", "--out", "{text}"], "exists and is not empty; pass --force"),
])
def test_cli_prepare_errors_are_one_line(tmp_path, text_dir, capsys, args, needle):
    argv = [a.format(tmp=tmp_path, text=text_dir) for a in args]
    assert main(["prepare", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert not (tmp_path / "ds").exists()


def test_cli_train_on_unprepared_data_is_one_line(tmp_path, text_dir, capsys):
    assert main(["train", *TINY, "--train.data", str(text_dir), "--train.run_dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a prepared dataset" in err and len(err.splitlines()) == 1


def test_split_shorter_than_one_sequence(tmp_path, capsys):
    """A validation split of 42 tokens cannot hold one sequence of seq_len + 1 = 129: one line that
    names the split, its size, the need and the fixes, from the pre-launch check and the sampler."""
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("train text " * 100)
    (text / "b.txt").write_text("x" * 40)  # + the 2-byte separator = 42 validation tokens
    out = tmp_path / "ds"
    meta = prepare_dataset([text], out, val_fraction=0.5)
    assert meta["tokens"]["val"] == 42
    need = "has 42 tokens, fewer than one sequence needs (train.seq_len + 1 = 129)"
    with pytest.raises(SplitTooShortError) as e:
        check_seq_len(meta, 128, out)
    msg = str(e.value)
    assert isinstance(e.value, UserError) and "\n" not in msg
    assert msg.startswith(f"the validation split of {str(out)!r} {need}")
    assert "--val-fraction" in msg and "smaller --train.seq_len (at most 41)" in msg and "add more text" in msg
    check_seq_len(meta, 41, out)  # 42 tokens hold exactly one window of 41 + 1
    data = load_dataset(out)
    with pytest.raises(SplitTooShortError, match=r"the validation split .* " + re.escape(need)):
        WindowSampler(data.val, 128, seed=0, split="val", source=str(out))
    assert WindowSampler(data.val, 41, seed=0).windows == 1
    # through the CLI: one line, exit status 2 (refused before launch once _preflight calls check_seq_len)
    assert main(["train", *TINY, "--model.max_seq_len", "128", "--train.seq_len", "128", "--train.data", str(out),
                 "--train.run_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and need in err, err
