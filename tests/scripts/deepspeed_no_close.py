"""An ordinary DeepSpeed loop that never calls ``engine.close()`` (issue 44, point 4): the model
and ``training_data=`` go to ``initialize``, it trains a few steps, saves and loads a checkpoint,
and simply ends. Run under ``torchrun --nproc-per-node 2``; every rank must exit 0.

    torchrun --nproc-per-node 2 tests/scripts/deepspeed_no_close.py SAVE_DIR [ZERO_STAGE]
"""

from __future__ import annotations

import atexit
import sys

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import hybridpar as deepspeed


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    save_dir, stage = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
    # registered first, so it runs last of the exit handlers: what interpreter finalization will meet
    atexit.register(lambda: print(f"groups alive at finalization: {dist.is_initialized()}", flush=True))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=16,
                                       bos_token_id=0, eos_token_id=0))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=Tokens(), config=cfg)
    for batch in loader:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(save_dir)
    engine.load_checkpoint(save_dir)
    print(f"rank {engine.global_rank}: done at step {engine.global_steps}", flush=True)


if __name__ == "__main__":
    main()
