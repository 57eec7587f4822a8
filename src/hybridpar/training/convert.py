"""``hybridpar convert``: a hybridpar checkpoint exported as Hugging Face weights of its family
(``config.json`` + ``model.safetensors`` + the tokenizer), loadable by ``transformers``."""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridpar.config import ConfigError
from hybridpar.models.hf import save_hf
from hybridpar.models.registry import family_of

__all__ = ["cmd_convert"]


def _convert_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridpar convert",
                                description="Export a hybridpar checkpoint as Hugging Face weights of its "
                                            "model family (LlamaForCausalLM, Qwen3ForCausalLM, ...).")
    p.add_argument("checkpoint", help="a hybridpar checkpoint directory")
    p.add_argument("--to-hf", required=True, metavar="DIR",
                   help="output directory (config.json + model.safetensors + the tokenizer's tokenizer.json)")
    p.add_argument("--overwrite", action="store_true", help="replace DIR if it exists and is not empty")
    return p


def cmd_convert(argv: list[str]) -> int:
    """``hybridpar convert CHECKPOINT --to-hf DIR [--overwrite]``."""
    args = _convert_parser().parse_args(argv)
    # looked up at call time: torch.distributed.checkpoint loads only when used
    from hybridpar.training.checkpoint import load_model_state, load_tokenizer_of

    if not Path(args.checkpoint).is_dir():
        raise ConfigError(f"checkpoint {args.checkpoint!r} is not a directory; pass a hybridpar checkpoint directory")
    try:
        cfg, state = load_model_state(args.checkpoint)
        tokenizer = load_tokenizer_of(args.checkpoint)
        out = save_hf(state, cfg.model, args.to_hf, overwrite=args.overwrite, tokenizer=tokenizer)
    except FileExistsError as e:
        raise ConfigError(str(e)) from None
    arch = family_of(cfg.model).hf.architecture
    print(f"hybridpar: wrote {cfg.model.num_params() / 1e6:.2f}M parameters as Hugging Face {arch} to {out}, "
          f"with its {tokenizer.kind} tokenizer (vocab {tokenizer.vocab_size})")
    return 0
