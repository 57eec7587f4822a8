"""Users' own data in ``hybridpar prepare``: JSON Lines (plain, .gz, .zst), Parquet, CSV and Arrow
(``save_to_disk``) inputs, a Hugging Face tokenizer saved as a model directory (BOS/EOS framing,
recorded and checked against ``train.init_from``), the document index, one-line errors for bad
input, and training on the result end to end."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import numpy as np
import pytest

from hybridpar.cli import main
from hybridpar.data.dataset import check_tokenizer, load_dataset, read_meta
from hybridpar.data.errors import DataError, TokenizerMismatchError, check_vocab
from hybridpar.data.hf_tokenizer import HFTokenizer
from hybridpar.data.prepare import prepare_dataset
from hybridpar.data.tokenizer import load_tokenizer, save_tokenizer

WORDS = ["alpha", "beta", "gamma", "delta", "tensor", "shard", "token", "héllo", "naïve", "π", "loss", "step"]
N_DOCS = 40


def _docs(seed: int = 0, n: int = N_DOCS) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(n)]


def _save_model_dir(directory: Path, texts: list[str], bos: str | None = "<s>", eos: str | None = "</s>",
                    vocab: int = 300) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [t for t in (bos, eos) if t]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "add_bos_token": True}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return _save_model_dir(tmp_path_factory.mktemp("hf") / "model", _docs(seed=1, n=200))


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return _docs()


def _write(fmt: str, root: Path, docs: list[str], field: str = "text") -> Path:
    rows = [{"id": i, field: d} for i, d in enumerate(docs)]
    if fmt.startswith(("jsonl", "json")):
        body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
        path = root / f"docs.{fmt}"
        if fmt.endswith(".gz"):
            body = gzip.compress(body)
        elif fmt.endswith(".zst"):
            import pyarrow as pa

            with pa.output_stream(str(path), compression="zstd") as f:
                f.write(body)
            return path
        path.write_bytes(body)
        return path
    import pyarrow as pa

    table = pa.table({"id": [r["id"] for r in rows], field: [r[field] for r in rows]})
    if fmt == "parquet":
        import pyarrow.parquet as pq

        path = root / "docs.parquet"
        pq.write_table(table, str(path), row_group_size=7)  # several row groups
    elif fmt == "csv":
        from pyarrow import csv

        path = root / "docs.csv"
        csv.write_csv(table, str(path))
    elif fmt == "arrow":
        path = root / "docs.arrow"
        with pa.ipc.new_file(str(path), table.schema) as w:
            w.write_table(table, max_chunksize=9)
    elif fmt == "save_to_disk":
        datasets = pytest.importorskip("datasets")
        path = root / "hf_dataset"
        datasets.Dataset.from_dict(table.to_pydict()).save_to_disk(str(path), max_shard_size="1KB")
    else:
        raise AssertionError(fmt)
    return path


def _expected(tok: HFTokenizer, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of [BOS] doc [EOS] for each doc, and each document's start offset."""
    arrays = [np.asarray([tok.bos_id, *tok.tok.encode(d, add_special_tokens=False).ids, tok.eos_id]) for d in docs]
    return np.concatenate(arrays), np.cumsum([0] + [len(a) for a in arrays[:-1]])


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst", "json", "parquet", "csv", "arrow", "save_to_disk"])
def test_each_format_gives_the_documents_framed_by_bos_and_eos(tmp_path, model_dir, docs, fmt):
    src = _write(fmt, tmp_path, docs)
    out = tmp_path / "ds"
    meta = prepare_dataset([src], out, tokenizer=model_dir, val_fraction=0.1)
    tok = HFTokenizer.from_path(model_dir)
    assert meta["documents"] == N_DOCS and meta["sources"][0]["records"] == N_DOCS
    assert meta["framing"] == {"bos_id": tok.bos_id, "eos_id": tok.eos_id, "separator": ""}
    data = load_dataset(out)
    train, train_docs = _expected(tok, docs[:36])  # int(40 * 0.1) = 4 validation documents, the last ones
    val, val_docs = _expected(tok, docs[36:])
    np.testing.assert_array_equal(data.train, train)
    np.testing.assert_array_equal(data.val, val)
    np.testing.assert_array_equal(data.train_docs, train_docs)
    np.testing.assert_array_equal(data.val_docs, val_docs)
    assert data.tokenizer.kind == "hf" and data.decode(data.encode(docs[0])) == docs[0]


def test_text_files_framing_flags_and_the_document_index(tmp_path, model_dir, docs):
    text = tmp_path / "text"
    text.mkdir()
    for i, d in enumerate(docs[:5]):
        (text / f"d{i}.md" if i % 2 else text / f"d{i}.txt").write_text(d)
    tok = HFTokenizer.from_path(model_dir)
    meta = prepare_dataset([text], tmp_path / "a", tokenizer=model_dir / "tokenizer.json", bos=False, val_fraction=0.2)
    ids = [tok.tok.encode(d, add_special_tokens=False).ids for d in docs[:5]]
    data = load_dataset(tmp_path / "a")
    np.testing.assert_array_equal(data.train, np.concatenate([[*i, tok.eos_id] for i in ids[:4]]))
    assert meta["framing"]["bos_id"] is None and list(data.train_docs) == list(np.cumsum([0] + [len(i) + 1 for i in ids[:3]]))
    # neither BOS nor EOS: documents end with a blank line, as with the byte and BPE tokenizers
    prepare_dataset([text], tmp_path / "b", tokenizer=model_dir, bos=False, eos=False, val_fraction=0.2)
    np.testing.assert_array_equal(load_dataset(tmp_path / "b").val, tok.tok.encode(docs[4] + "\n\n").ids)
    # the byte tokenizer reads JSON Lines too (each record's UTF-8 bytes and the separator)
    src = _write("jsonl", tmp_path, docs[:3])
    data = load_dataset(Path(prepare_dataset([src], tmp_path / "c", val_fraction=0.34) and tmp_path / "c"))
    assert bytes(data.train.astype(np.uint8)) == "".join(d + "\n\n" for d in docs[:2]).encode()
    assert list(data.train_docs) == [0, len(docs[0].encode()) + 2]


def test_tokenizer_is_recorded_copied_and_checked_against_init_from(tmp_path, model_dir, docs, capsys):
    src = _write("jsonl", tmp_path, docs)
    out = tmp_path / "ds"
    meta = prepare_dataset([src], out, tokenizer=model_dir)
    info = meta["tokenizer"]
    assert info["kind"] == "hf" and info["files"] == ["tokenizer.json", "tokenizer_config.json"]
    for name in info["files"]:
        assert (out / name).read_bytes() == (model_dir / name).read_bytes()
    assert info["bos_token"] == "<s>" and info["eos_token"] == "</s>" and info["source"] == str(model_dir)
    check_tokenizer(read_meta(out), out, model_dir)  # same tokenizer: fine
    check_tokenizer(read_meta(out), out, "")  # no init_from: nothing to check
    check_tokenizer(read_meta(out), out, tmp_path)  # no tokenizer.json there: nothing to check
    other = _save_model_dir(tmp_path / "other", _docs(seed=5, n=50), vocab=280)
    with pytest.raises(TokenizerMismatchError) as e:
        check_tokenizer(read_meta(out), out, other)
    msg = str(e.value)
    assert f"dataset {str(out)!r} was tokenized with the tokenizer from {str(model_dir)!r}" in msg
    assert f"--train.init_from {str(other)!r}" in msg and "\n" not in msg
    prepare_dataset([src], tmp_path / "bytes")
    with pytest.raises(TokenizerMismatchError, match="tokenized with the byte tokenizer, not the tokenizer of"):
        check_tokenizer(read_meta(tmp_path / "bytes"), tmp_path / "bytes", model_dir)
    with pytest.raises(DataError, match=r"data vocabulary 300 > model.vocab_size = 256 \(dataset 'ds', tokenizer hf\)"):
        check_vocab(300, 256, "ds", "hf")
    # checkpoints carry it (save_tokenizer / load_tokenizer), convert exports it
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    tok = load_dataset(out).tokenizer
    save_tokenizer(tok, ckpt)
    again = load_tokenizer(json.loads((ckpt / "tokenizer-info.json").read_text()), ckpt)
    assert again.encode(docs[1]) == tok.encode(docs[1]) and again.encode(docs[1])[0] == tok.bos_id
    assert (ckpt / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    hf = tmp_path / "hf"
    hf.mkdir()
    tok.export_hf(hf, model_max_length=64)
    assert json.loads((hf / "tokenizer_config.json").read_text())["model_max_length"] == 64
    assert json.loads((hf / "tokenizer_config.json").read_text())["bos_token"] == "<s>"


def _bad(case: str, root: Path, model_dir: Path, docs: list[str]) -> tuple[list[Path], dict, str]:
    kw: dict = {"tokenizer": model_dir}
    if case == "malformed_jsonl":
        path = root / "bad.jsonl"
        path.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"\n')
        return [path], kw, f"{path}:3: malformed JSON on line 3 (Expecting ',' delimiter"
    if case == "missing_field":
        path = root / "bad.jsonl"
        path.write_text('{"content": "a", "id": 1}\n')
        return [path], kw, "line 1 has no field 'text' (fields: 'content', 'id'); pass --text-field NAME"
    if case == "not_utf8_jsonl":
        path = root / "bad.jsonl"
        path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
        return [path], kw, "bad.jsonl:2: line 2 is not UTF-8 text"
    if case == "not_utf8_text":
        path = root / "bad.txt"
        path.write_bytes(b"abc\xff\xfe")
        return [path], kw, "bad.txt' is not UTF-8 text (invalid byte at offset 3); the hf tokenizer needs UTF-8"
    if case == "empty_corpus":
        path = root / "empty.jsonl"
        path.write_text("\n  \n")
        return [path], kw, "empty corpus: the 1 inputs ("
    if case == "not_a_tokenizer_file":
        (root / "tok.json").write_text('{"hello": 1}')
        return [_write("jsonl", root, docs)], {"tokenizer": root / "tok.json"}, \
            f"--tokenizer {str(root / 'tok.json')!r} is not a tokenizer: tokenizers cannot load tok.json"
    if case == "not_a_tokenizer_dir":
        (root / "model").mkdir()
        (root / "model" / "tokenizer.model").write_bytes(b"\x00")
        return [_write("jsonl", root, docs)], {"tokenizer": root / "model"}, \
            "is not a tokenizer: the directory has no tokenizer.json (it has only a sentencepiece tokenizer.model"
    if case == "parquet_column":
        return [_write("parquet", root, docs, field="body")], kw, \
            "docs.parquet' has no column 'text' (columns: 'id', 'body'); pass --text-field NAME"
    if case == "csv_column":
        return [_write("csv", root, docs, field="body")], kw, "docs.csv' has no column 'text' (columns: 'id', 'body')"
    if case == "unknown_suffix":
        (root / "docs.xml").write_text("<a/>")
        return [root / "docs.xml"], kw, "docs.xml' (.xml) is not a format hybridpar prepare reads: text (.txt, .md), JSON Lines"
    if case == "gzip_named_txt":
        (root / "docs.txt").write_bytes(gzip.compress(b"hello"))
        return [root / "docs.txt"], {}, "docs.txt' is gzip-compressed, not text; hybridpar prepare reads text (.txt, .md)"
    if case == "nul_in_txt":
        (root / "docs.txt").write_bytes(b"hello\x00world")
        return [root / "docs.txt"], {}, "docs.txt' is binary (a NUL byte at offset 5), not text"
    raise AssertionError(case)


BAD = ["malformed_jsonl", "missing_field", "not_utf8_jsonl", "not_utf8_text", "empty_corpus", "not_a_tokenizer_file",
       "not_a_tokenizer_dir", "parquet_column", "csv_column", "unknown_suffix", "gzip_named_txt", "nul_in_txt"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_before_any_output(tmp_path, model_dir, docs, case):
    inputs, kw, needle = _bad(case, tmp_path, model_dir, docs)
    out = tmp_path / "out"
    with pytest.raises(DataError) as info:
        prepare_dataset(inputs, out, **kw)
    msg = str(info.value)
    assert needle in msg and "\n" not in msg, msg
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_cli_prints_bad_input_as_one_line(tmp_path, model_dir, docs, capsys):
    inputs, _, needle = _bad("missing_field", tmp_path, model_dir, docs)
    assert main(["prepare", "--input", str(inputs[0]), "--tokenizer", str(model_dir), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hybridpar: error: ") and needle in err and len(err.splitlines()) == 1


BASE = [
    "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
    "--model.ffn_hidden", "64", "--model.max_seq_len", "64", "--train.seq_len", "32",
    "--train.global_batch", "4", "--train.micro_batch", "2",
    "--train.log_every", "1", "--train.eval_every", "0", "--train.sample_tokens", "8",
]


def test_prepare_jsonl_with_the_hf_tokenizer_and_train(tmp_path, model_dir, capsys):
    src = _write("jsonl", tmp_path, _docs(seed=3, n=80))
    out = tmp_path / "ds"
    assert main(["prepare", "--input", str(src), "--tokenizer", str(model_dir), "--out", str(out),
                 "--val-fraction", "0.2", "--text-field", "text"]) == 0
    assert f"hybridpar: prepared {out}" in capsys.readouterr().out
    vocab = read_meta(out)["vocab_size"]
    run = tmp_path / "run"
    assert main(["train", *BASE, "--train.steps", "2", "--train.data", str(out), "--model.vocab_size", str(vocab),
                 "--train.run_dir", str(run)]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    from hybridpar.training.checkpoint import load_tokenizer_of

    (ckpt,) = (run / "checkpoints").glob("step-*")  # the checkpoint carries the dataset's tokenizer
    assert load_tokenizer_of(ckpt).kind == "hf"
    assert (ckpt / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "alpha beta", "--tokens", "4"]) == 0
    assert "<s>" not in capsys.readouterr().out  # decoded with the tokenizer, special tokens skipped


def test_records_are_checked_while_writing_and_a_bad_one_leaves_nothing(tmp_path, monkeypatch, model_dir, docs):
    """Each record is parsed once, checked as it is written into the hidden temporary directory: a
    bad line after many batches were written is the same one-line error naming the line in the
    whole file, and neither the output nor the temporary directory is left behind."""
    import hybridpar.data.prepare as prepare
    import hybridpar.data.sources as sources

    monkeypatch.setattr(prepare, "BATCH_DOCS", 8)  # many batches written before the bad line
    src = _write("jsonl", tmp_path, docs * 5)
    record, calls = sources.JsonlSource._record, []
    monkeypatch.setattr(sources.JsonlSource, "_record", lambda self, n, line: calls.append(n) or record(self, n, line))
    prepare_dataset([src], tmp_path / "ok", tokenizer=model_dir)
    assert calls == [1, *range(1, 5 * N_DOCS + 1)]  # every line once, the first one also by the up-front check
    lines = src.read_text().splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines[:170]) + '{"text": 1}\n' + "".join(lines[170:]))
    with pytest.raises(DataError, match=r"bad.jsonl:171: field 'text' on line 171 is a JSON int, not a string"):
        prepare_dataset([src, bad], tmp_path / "out", tokenizer=model_dir)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.parametrize("shard_tokens", [1 << 20, 37])
def test_the_validation_cut_skips_empty_records_and_splits_shards(tmp_path, monkeypatch, model_dir, docs, shard_tokens):
    """Documents stream into one token stream that is cut at the end: val starts at the first
    document of record ``first_val`` (empty records have none), a shard holding the cut is
    truncated, and the result does not depend on the batch or shard size."""
    import hybridpar.data.prepare as prepare

    monkeypatch.setattr(prepare, "BATCH_DOCS", 3)
    texts: list[str | None] = list(docs[:20])
    for i in (4, 17, 18):  # 20 records, first_val = 18: records 17 and 18 are empty
        texts[i] = None if i % 2 else ""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    meta = prepare_dataset([src], tmp_path / "ds", tokenizer=model_dir, val_fraction=0.1, shard_tokens=shard_tokens)
    tok = HFTokenizer.from_path(model_dir)
    kept = [t for t in texts if t]
    train, train_docs = _expected(tok, kept[:16])
    val, val_docs = _expected(tok, kept[16:])
    data = load_dataset(tmp_path / "ds")
    assert meta["documents"] == 20 and meta["splits"]["train"]["documents"]["count"] == 16
    np.testing.assert_array_equal(data.train, train)
    np.testing.assert_array_equal(data.val, val)
    np.testing.assert_array_equal(data.train_docs, train_docs)
    np.testing.assert_array_equal(data.val_docs, val_docs)
    assert all(s["tokens"] <= shard_tokens for e in meta["splits"].values() for s in e["shards"])
    assert sorted(p.name for p in (tmp_path / "ds").iterdir() if not p.name.startswith(("train-0", "val-0"))) == \
        ["meta.json", "tokenizer.json", "tokenizer_config.json", "train-docs.bin", "val-docs.bin"]


def test_a_long_text_file_is_encoded_in_pieces_across_batches(tmp_path, monkeypatch, model_dir, docs):
    """A plain-text document over PIECE_CHARS is encoded in pieces cut after a newline, spread over
    several batches: one document, framed once, with the tokens of the whole text."""
    import hybridpar.data.prepare as prepare
    import hybridpar.data.readers as readers

    monkeypatch.setattr(readers, "PIECE_CHARS", 60)
    monkeypatch.setattr(prepare, "BATCH_CHARS", 150)
    monkeypatch.setattr(prepare, "BATCH_TOKENS", 30)
    text = "\n".join(docs)
    (tmp_path / "long.txt").write_text(text)
    (tmp_path / "short.txt").write_text(docs[0])
    prepare_dataset([tmp_path / "long.txt", tmp_path / "short.txt"], tmp_path / "ds", tokenizer=model_dir,
                    val_fraction=0.5)
    tok = HFTokenizer.from_path(model_dir)
    data = load_dataset(tmp_path / "ds")
    np.testing.assert_array_equal(data.train, _expected(tok, [text])[0])
    np.testing.assert_array_equal(data.val, _expected(tok, [docs[0]])[0])
    assert list(data.train_docs) == [0] and list(data.val_docs) == [0]
