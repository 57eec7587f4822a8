"""The planner against Megatron-LM's Table 1 (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", arXiv:2104.04473).

Each row is evaluated as published: GPT shapes (heads, hidden, layers), sequence 2048, vocabulary
51200, A100-80GB DGX nodes (8 GPUs, 8x200 Gb/s HDR), the row's (tp, pp, GPUs, global batch),
full activation recomputation, mixed precision without ZeRO (the paper used none). Micro-batch
size, schedule and virtual stages are not in the table: the planner picks the fastest for the
layout, as ``hybridpar plan --layout`` does, among the schedules the paper had (1F1B,
interleaved). Megatron reports hardware TFLOP/s (recomputation
counted), so that is what is compared. No row-specific factor exists anywhere in the planner.

    python benchmarks/planner_megatron.py
"""

from __future__ import annotations

import json
import statistics

from hybridpar.config import ModelConfig
from hybridpar.planner.machine.hardware import Cluster, gpu_spec
from hybridpar.planner.model.layout import BlockStyle, Workload
from hybridpar.planner.search.search import complete

# (params B, heads, hidden, layers, tp, pp, GPUs, batch, published TFLOP/s per GPU)
TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
SEQ, VOCAB = 2048, 51200


def gpt(heads: int, hidden: int, layers: int) -> ModelConfig:
    """GPT's shape as a Llama config: MHA, SwiGLU of width 8h/3 rounded up to a multiple of 128
    (about GPT's 4h GELU parameters; ``BlockStyle.MEGATRON`` times the MLP as 4h GELU)."""
    ffn = -(-8 * hidden // 3 // 128) * 128
    return ModelConfig(preset="gpt", dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                       ffn_hidden=ffn, vocab_size=VOCAB, max_seq_len=SEQ, tie_embeddings=True)


def main() -> None:
    rows = []
    for params, heads, hidden, layers, tp, pp, gpus, batch, published in TABLE1:
        cluster = Cluster.of(gpu_spec("A100-80GB"), gpus, 8)
        layout = {"tp": tp, "pp": pp, "cp": 1, "dp": gpus // (tp * pp), "zero_stage": 0,
                  "recompute": "full", "sequence_parallel": False}
        # the schedules Megatron-LM had in 2021 (no zero-bubble): the faster of the two
        options = [complete(gpt(heads, hidden, layers), {**layout, "pipeline_schedule": s},
                            Workload(batch, SEQ, "fp16", style=BlockStyle.MEGATRON), cluster)[0]
                   for s in (["1f1b", "interleaved"] if pp > 1 else ["1f1b"])]
        fitting = [e for e in options if e.fits and e.cost is not None]
        best = min(fitting, key=lambda e: e.cost.step_time_s) if fitting else options[0]
        c, L = best.cost, best.layout
        predicted = c.hw_tflops_per_gpu if c is not None else float("nan")
        sched = f"{L.pipeline_schedule}{' V=' + str(L.virtual_stages) if L.virtual_stages > 1 else ''}"
        rows.append({"params_b": params, "tp": tp, "pp": pp, "gpus": gpus, "batch": batch,
                     "published_tflops": published, "predicted_tflops": round(predicted, 1),
                     "error": round(predicted / published - 1, 4), "micro_batch": L.micro_batch,
                     "schedule": sched, "fits": best.fits,
                     "bubble": round(c.bubble_fraction, 4) if c is not None else None})
    print("| params (B) | tp | pp | GPUs | batch | published TFLOP/s | predicted | error | planner's choice (mb, schedule) | bubble |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['params_b']:g} | {r['tp']} | {r['pp']} | {r['gpus']} | {r['batch']} | {r['published_tflops']} | "
              f"{r['predicted_tflops']:.1f} | {100 * r['error']:+.1f}% | {r['micro_batch']}, {r['schedule']} | "
              f"{100 * (r['bubble'] or 0):.1f}% |")
    mae = statistics.mean(abs(r["error"]) for r in rows)
    print(f"\nmean absolute error {100 * mae:.1f}%; all fit: {all(r['fits'] for r in rows)}")
    print(json.dumps({"benchmark": "planner_megatron", "mean_abs_error": round(mae, 4), "rows": rows}))


if __name__ == "__main__":
    main()
