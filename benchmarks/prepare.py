"""``hybridpar prepare`` throughput and memory, side by side with a plain ``tokenizers`` loop.

Generates a corpus of random words as JSON Lines (nothing downloaded) and trains a byte-level BPE
tokenizer on a sample of it with ``tokenizers``, saved as a Hugging Face model directory
(``tokenizer.json`` + ``tokenizer_config.json`` with BOS/EOS). Then, each in a fresh process on
the same cores, alternating over ``--rounds``:

- ``hybridpar prepare --input corpus.jsonl --tokenizer DIR --out ...`` (the CLI, progress bar on),
- the plain loop a user would write: read the JSON Lines with ``json``, ``encode_batch`` batches of
  1000 documents with the same tokenizer (the library's fast variant, all cores), count tokens.

Reported: tokens/s of both (the corpus's document tokens over each one's best wall time inside
its process, imports excluded: each side imports its modules, ``hybridpar.data.prepare`` or
``tokenizers``, before its clock starts) and their ratio (target >= 0.9), the same ratio with the
imports' time included, the CPU seconds of both (on a busy machine wall times are noisy; CPU time
shows the extra work), and the peak RSS of both on the corpus and on one 4x larger (target for
``prepare``: equal within 10%). Both corpora draw their words from one vocabulary (the larger is
more of the same text, not denser text: with a vocabulary of its own it would give ~1.5x more
tokens per byte with the tokenizer trained on the smaller one, and peak memory would measure that).

    python benchmarks/prepare.py [--mb 16] [--scale 4] [--rounds 2] [--vocab 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATCH_DOCS = 1000


def make_corpus(path: Path, mb: float, seed: int = 0, vocab_seed: int = 0) -> int:
    """Random words as JSON Lines, ``mb`` MiB, documents of 50-2000 words; returns documents. The
    words come from a vocabulary drawn with ``vocab_seed``, the documents with ``seed``."""
    vrng = random.Random(vocab_seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "an", "el", "ver", "qu", "ix", "or", "um", "zé"]
    vocab = ["".join(vrng.choice(syllables) for _ in range(vrng.randint(1, 4))) for _ in range(20000)]
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(len(vocab))]  # Zipf-like
    target, n, size = int(mb * (1 << 20)), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            words = rng.choices(vocab, weights, k=rng.randint(50, 2000))
            line = json.dumps({"id": n, "text": " ".join(words) + "."}, ensure_ascii=False) + "\n"
            f.write(line)
            size += len(line.encode())
            n += 1
    return n


def make_tokenizer(directory: Path, corpus: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def sample():
        with open(corpus, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i >= 500:
                    return
                yield json.loads(line)["text"]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(sample(), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))


def child_prepare(corpus: str, tokenizer: str, out: str) -> dict:
    t_import = time.perf_counter()
    import tokenizers  # noqa: F401  (imported on the plain side's clock too, before it starts)

    import hybridpar.data.prepare  # noqa: F401  (the CLI imports it lazily: here, off the clock)
    from hybridpar.cli import main

    t0 = time.perf_counter()
    rc = main(["prepare", "--input", corpus, "--tokenizer", tokenizer, "--out", out, "--force"])
    wall = time.perf_counter() - t0
    meta = json.loads((Path(out) / "meta.json").read_text())
    return {"rc": rc, "wall_s": wall, "import_s": t0 - t_import,
            "tokens": meta["tokens"]["train"] + meta["tokens"]["val"], "documents": meta["documents"]}


def child_plain(corpus: str, tokenizer: str) -> dict:
    t_import = time.perf_counter()
    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    tok = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json"))
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    tokens = docs = 0
    batch: list[str] = []
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            batch.append(json.loads(line)["text"])
            if len(batch) == BATCH_DOCS:
                tokens += sum(len(e.ids) for e in encode(batch, add_special_tokens=False))
                docs += len(batch)
                batch = []
    if batch:
        tokens += sum(len(e.ids) for e in encode(batch, add_special_tokens=False))
        docs += len(batch)
    return {"rc": 0, "wall_s": time.perf_counter() - t0, "import_s": t0 - t_import, "tokens": tokens,
            "documents": docs}


def run_child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=16, help="size of the smaller corpus in MiB")
    ap.add_argument("--scale", type=float, default=4, help="the larger corpus is this many times bigger")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each side on the smaller corpus, alternating")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, *rest = args.child
        result = child_prepare(*rest) if kind == "prepare" else child_plain(*rest)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        result["peak_rss_mib"] = usage.ru_maxrss / 1024
        result["cpu_s"] = usage.ru_utime + usage.ru_stime  # all threads, imports included
        print(json.dumps(result))
        return

    with tempfile.TemporaryDirectory(prefix="hybridpar-bench-prepare-") as tmp:
        root = Path(tmp)
        small, large, model = root / "small.jsonl", root / "large.jsonl", root / "model"
        n_small = make_corpus(small, args.mb, seed=0)
        n_large = make_corpus(large, args.mb * args.scale, seed=1)
        make_tokenizer(model, small, args.vocab)
        runs: dict[str, list[dict]] = {"hybridpar prepare": [], "plain encode_batch": []}
        for _ in range(args.rounds):
            runs["hybridpar prepare"].append(run_child("prepare", str(small), str(model), str(root / "ds")))
            runs["plain encode_batch"].append(run_child("plain", str(small), str(model)))
        big = run_child("prepare", str(large), str(model), str(root / "ds-large"))
        big_plain = run_child("plain", str(large), str(model))

    doc_tokens = runs["plain encode_batch"][0]["tokens"]
    best = {k: min(r["wall_s"] for r in v) for k, v in runs.items()}
    tps = {k: doc_tokens / v for k, v in best.items()}
    ratio = tps["hybridpar prepare"] / tps["plain encode_batch"]
    best_all = {k: min(r["wall_s"] + r["import_s"] for r in v) for k, v in runs.items()}
    ratio_imports = best_all["plain encode_batch"] / best_all["hybridpar prepare"]
    rss_small = max(r["peak_rss_mib"] for r in runs["hybridpar prepare"])
    rss_ratio = big["peak_rss_mib"] / rss_small
    cpu = {k: min(r["cpu_s"] for r in v) for k, v in runs.items()}
    cpu_ratio = cpu["hybridpar prepare"] / cpu["plain encode_batch"]
    print(f"corpus {args.mb:g} MiB ({n_small} documents, {doc_tokens} tokens) and {args.mb * args.scale:g} MiB "
          f"({n_large} documents); BPE vocab {args.vocab}; {os.cpu_count()} cores; {args.rounds} rounds")
    print(f"{'side':<24}{'best wall (s)':>15}{'tokens/s':>12}{'CPU (s)':>10}{'peak RSS (MiB)':>16}")
    for k, v in runs.items():
        print(f"{k:<24}{best[k]:>15.2f}{tps[k]:>12.0f}{cpu[k]:>10.2f}{max(r['peak_rss_mib'] for r in v):>16.0f}")
    for name, r in (("prepare", big), ("plain encode_batch", big_plain)):
        print(f"{name + ', ' + format(args.scale, 'g') + 'x corpus':<24}{r['wall_s']:>15.2f}"
              f"{r['tokens'] / r['wall_s']:>12.0f}{r['cpu_s']:>10.2f}{r['peak_rss_mib']:>16.0f}")
    print(f"tokens/s ratio prepare / plain = {ratio:.3f} (target >= 0.9; {ratio_imports:.3f} with imports; "
          f"CPU seconds ratio {cpu_ratio:.3f}); "
          f"prepare's peak RSS {args.scale:g}x / 1x = {rss_ratio:.3f} (target within 10%, < 1 GiB)")
    print(json.dumps({"benchmark": "prepare", "tokens_per_s_ratio": round(ratio, 4), "target_ratio": 0.9,
                      "tokens_per_s_ratio_with_imports": round(ratio_imports, 4),
                      "import_s": {k: round(min(r["import_s"] for r in v), 3) for k, v in runs.items()},
                      "tokens_per_s": {k: round(v) for k, v in tps.items()},
                      "best_wall_s": {k: round(v, 3) for k, v in best.items()},
                      "peak_rss_mib": {"1x": round(rss_small, 1), f"{args.scale:g}x": round(big["peak_rss_mib"], 1)},
                      "rss_ratio": round(rss_ratio, 4), "cpu_s_ratio": round(cpu_ratio, 4),
                      "plain_peak_rss_mib": {"1x": round(max(r["peak_rss_mib"] for r in runs["plain encode_batch"]), 1),
                                             f"{args.scale:g}x": round(big_plain["peak_rss_mib"], 1)}, "corpus_mib": [args.mb, args.mb * args.scale],
                      "documents": [n_small, n_large], "rounds": args.rounds, "cores": os.cpu_count()}))


if __name__ == "__main__":
    main()
