"""Training stall per checkpoint: a synchronous save vs ``async_checkpoint.enabled``, side by side.

One process trains the model and checkpoints every ``--every`` steps, alternating a synchronous
and an asynchronous save (same trainer, same state, same run directory with
``train.keep_checkpoints = 1``), so both see the same machine. Per save:

* **stall**: how long the training loop stood still for the save: the whole save when
  synchronous (DCP write + fsync, manifest hashes, rename, retention); when asynchronous, the
  thread start plus any wait of the next optimizer step for the thread's host-memory copy of the
  state (the copy overlaps the next step's forward and backward) (target: async stall <= 10% of
  the sync save);
* for asynchronous saves, how long the background write took, and the median training step
  beside it next to the median step with no write in flight. On a GPU machine the writer uses
  host cores the GPU's training does not; on this 2-core machine it competes with training for
  the same cores (and for Python's GIL: DCP's planning and serialisation run Python code), so
  steps beside a write are slower. Step times on a machine shared with other jobs are noisy: read
  that column as a rough slowdown, the stall columns as the result.

    python benchmarks/checkpoint.py [--models tiny,100m] [--saves 3] [--every 3] [--dir DIR]

``100m`` is a Llama shape of 100.6M parameters (dim 768, 16 layers, 12 heads / 4 KV heads, SwiGLU
2048): a checkpoint of about 1.2 GB (weights and two AdamW moments, fp32).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hybridpar.config import load_config
from hybridpar.distributed.device import keep_host_heap
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.training.trainer import Trainer

MODELS = {
    "tiny": [],
    "100m": ["--model.dim", "768", "--model.n_layers", "16", "--model.n_heads", "12", "--model.n_kv_heads", "4",
             "--model.ffn_hidden", "2048"],
}
TRAIN = ["--train.seq_len", "64", "--train.global_batch", "2", "--train.micro_batch", "2", "--train.eval_every", "0",
         "--train.warmup_steps", "1", "--train.steps", "100000", "--train.keep_checkpoints", "1",
         "--async_checkpoint.enabled", "true"]


def measure(name: str, saves: int, every: int, root: Path) -> dict[str, float]:
    """Alternate ``saves`` synchronous and asynchronous checkpoints of model ``name``."""
    cfg = load_config(None, [*MODELS[name], *TRAIN, "--train.run_dir", str(root / name)])
    keep_host_heap()  # as the CLI trainer's workers do on CPU
    trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel).build("cpu"))
    writer = trainer.writer
    assert writer is not None
    step = 0

    def train() -> float:
        nonlocal step
        step += 1
        start = time.perf_counter()
        trainer.train_step(step)
        writer.poll()  # what the loop does at each step boundary (raises a failed write)
        return time.perf_counter() - start

    for _ in range(2):  # warm-up
        train()
    stall: dict[str, list[float]] = {"sync": [], "async": []}
    quiet: list[float] = []
    beside: list[float] = []
    writes: list[float] = []
    for _ in range(saves):
        for mode in ("sync", "async"):
            before = [train() for _ in range(every)]  # no write in flight
            quiet += before
            trainer.writer = writer if mode == "async" else None
            start = time.perf_counter()
            trainer.save_checkpoint(step)
            stall[mode].append(time.perf_counter() - start)
            trainer.writer = writer
            if mode == "async":
                during = []
                while writer.busy:  # train on while the thread writes
                    during.append(train())
                writer.wait()
                stall[mode][-1] += writer.held_s  # the optimizer step's wait for the copy, if any
                writes.append(writer.last_write_s)
                beside += during
    sync, asyn = statistics.median(stall["sync"]), statistics.median(stall["async"])
    return {
        "params_m": cfg.model.num_params() / 1e6,
        "state_mb": writer.stager.nbytes / 2**20,
        "sync_save_s": sync,
        "async_stall_s": asyn,
        "stall_ratio": asyn / sync,
        "background_write_s": statistics.median(writes),
        "steps_beside_write": len(beside) / saves,
        "step_s": statistics.median(quiet),
        "step_s_beside_write": statistics.median(beside) if beside else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,100m", help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--saves", type=int, default=3, help="checkpoints of each kind per model")
    ap.add_argument("--every", type=int, default=3, help="training steps before each checkpoint")
    ap.add_argument("--dir", default=None, help="where the run directories go (default: a temporary one)")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="hybridpar-ckpt-bench-"))
    results = {}
    try:
        for name in args.models.split(","):
            results[name] = measure(name, args.saves, args.every, root)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"one process, torch threads {torch.get_num_threads()}; {args.saves} saves of each kind per model, "
          f"every {args.every} steps; medians")
    head = (f"{'model':<7}{'params':>8}{'state':>9}{'sync save':>11}{'async stall':>13}{'ratio':>7}"
            f"{'bg write':>10}{'step':>8}{'step beside write':>19}")
    print(head)
    for name, r in results.items():
        print(f"{name:<7}{r['params_m']:>7.1f}M{r['state_mb']:>7.0f}MB{r['sync_save_s']:>10.3f}s"
              f"{r['async_stall_s']:>12.4f}s{r['stall_ratio']:>7.3f}{r['background_write_s']:>9.3f}s"
              f"{r['step_s']:>7.3f}s{r['step_s_beside_write']:>18.3f}s")
    print("ratio = async stall / sync save (target <= 0.10); step: median training step with no write in flight, "
          "and with the background write running")
    print(json.dumps({"benchmark": "checkpoint", "target_stall_ratio": 0.10, "saves": args.saves,
                      "models": {k: {m: round(v, 5) for m, v in r.items()} for k, r in results.items()}}))


if __name__ == "__main__":
    main()
