"""The ``[train]`` section: the recipe (batch, schedule, precision, logging, checkpoints, data)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Precision", "TrainConfig"]

Precision = Literal["fp32", "bf16", "fp16"]


@dataclass
class TrainConfig:
    """The recipe. Batch sizes count sequences; ``global_batch`` is per optimizer step."""

    steps: int = 300
    global_batch: int = 16
    micro_batch: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 30
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    precision: Precision = "fp32"
    seed: int = 1234
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    checkpoint_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 0  # keep the newest K complete checkpoints, delete older ones; 0 = keep all
    # in-memory snapshots to the launcher's per-node store (and a peer node's): steps between them;
    # -1 = every step when the launcher keeps a store (--max-restarts, --elastic), else off; 0 = off
    snapshot_every: int = -1
    snapshot_memory_fraction: float = 0.5  # snapshots may use at most this share of the node's available memory
    compile: bool = False  # torch.compile each transformer block (regional compilation)
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"  # aot_eager: traced graphs, eager kernels
    # the optimizer's kernel: auto (torch's fused Adam/AdamW/SGD where the device and dtype support it),
    # fused, foreach or for-loop (checked by the rule train-optimizer-impl)
    optimizer_impl: str = "auto"
    run_dir: str = "runs/default"
    data: str = "builtin"
    sample_tokens: int = 200
    sample_prompt: str = "def "  # the text sample.txt continues
    device: Literal["auto", "cpu", "cuda"] = "auto"
    loss_scale_init: float = 65536.0  # fp16 dynamic loss scale: start value
    loss_scale_window: int = 200  # fp16: clean steps before the scale doubles
    nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/Inf loss stops the run, or skips the step
    max_skipped_steps: int = 10  # with nonfinite = "skip": stop after this many skipped steps
    timeout_s: float = 300.0  # a collective or p2p that takes longer ends the job with a report
    init_from: str = ""  # a Hugging Face Llama directory to start from; "" = random init from seed
    hardware: str = ""  # parallel.auto's device: a GPU name or calibrated profile; "" = the default profile
    auto_resume: bool = True  # when torchrun restarts the job, continue from the latest complete checkpoint
    document_mask: bool = False  # packed documents: attention stays within each document, RoPE restarts per document
    # the head and loss in chunks of this many tokens (per micro-batch and rank), so the whole fp32 logits
    # never exist; micro-batches of at most this many tokens are not chunked; 0 = never chunk
    loss_chunk_tokens: int = 4096
