"""What the planner's memory-bound terms count, measured op by op on this runtime's eager Llama
block (:class:`hybridpar.models.llama.Block`) with a ``TorchDispatchMode``:

* the bytes its element-wise ops read and write per token, forward and backward (everything but
  the GEMMs, the attention kernel, views and the weight casts, which
  :func:`hybridpar.planner.price.rates.weight_traffic` prices), in fp32, bf16 with half
  parameters, and bf16 under autocast. :func:`hybridpar.planner.price.cost.eager_elementwise_bytes`
  states the fit;
* the bytes one torch AdamW step moves per parameter
  (:data:`hybridpar.planner.price.dp_cost.FOREACH_ADAMW_BYTES`);
* what torchtitan's op-level selective checkpointing policy saves and reruns on this block
  (:mod:`hybridpar.planner.model.sac`).

``tests/test_planner_kernels.py`` asserts them against the planner's formulas.

    python benchmarks/planner_kernels.py      # the per-width fit of the element-wise bytes
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from hybridpar.config import ModelConfig
from hybridpar.models.llama.model import Block, precompute_rope

MODES = ("fp32", "half", "autocast")  # fp32; bf16 parameters; fp32 parameters under bf16 autocast
GEMMS = {"mm", "addmm", "bmm", "matmul", "linear"}
aten = torch.ops.aten
# torchtitan's _save_list (parallelize_llama.py at 9dec370) plus the CPU flash kernel, this
# machine's counterpart of the CUDA flash kernel in the list
SAC_SAVE = {aten.mm.default, aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default, aten.abs.default, aten.max.default}


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches for ``t``: its elements, or its storage when broadcast (expanded)."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class ElementwiseBytes(TorchDispatchMode):
    """Sums the bytes every element-wise op dispatched inside it reads (its tensor arguments) and
    writes (its outputs; an in-place op's mutated arguments). Left out: GEMMs, attention, views,
    and ops touching a tensor of a weight's shape (``weight_shapes``: autocast's weight casts,
    the weight gradients' casts)."""

    def __init__(self, weight_shapes: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.weight_shapes, self.bytes = weight_shapes, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.is_view or name in GEMMS or "scaled_dot_product" in name or "flash" in name:
            return out
        ins = _tensors((args, kwargs))
        schema = func._schema.arguments
        written = [t for a, v in zip(schema, args, strict=False) if a.alias_info is not None and a.alias_info.is_write
                   for t in _tensors(v)]
        outs = written or _tensors(out)
        if any(tuple(t.shape) in self.weight_shapes for t in ins + outs):
            return out
        storages = {t.untyped_storage().data_ptr() for t in ins}
        if not written and outs and all(o.untyped_storage().data_ptr() in storages for o in outs):
            return out  # an alias the schema does not mark as a view (``_unsafe_view``)
        self.bytes += sum(_nbytes(t) for t in ins + outs)
        return out


def llama_shape(h: int, heads: int, kv_heads: int, head_dim: int, f: int, seq: int) -> ModelConfig:
    """A one-layer Llama of these widths (``q = heads * head_dim`` may differ from ``h``)."""
    return ModelConfig(preset="custom", dim=h, n_layers=1, n_heads=heads, n_kv_heads=kv_heads, ffn_hidden=f,
                       vocab_size=128, max_seq_len=seq, kv_channels=head_dim)


def _block(cfg: ModelConfig, mode: str, batch: int, seq: int) -> tuple[Block, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if mode == "half" else torch.float32
    block = Block(cfg).to(dtype)
    cos, sin = precompute_rope(cfg.head_dim, torch.arange(seq), cfg.rope_theta)
    x = torch.randn(batch, seq, cfg.dim, dtype=dtype, requires_grad=True)
    return block, x, cos, sin


def _run(mode: str, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    if mode == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn()
    return fn()


def elementwise_bytes(cfg: ModelConfig, mode: str, batch: int = 4, seq: int = 250) -> tuple[float, float]:
    """(forward, backward) element-wise bytes per token of one block in ``mode`` (module doc)."""
    block, x, cos, sin = _block(cfg, mode, batch, seq)
    shapes = {tuple(p.shape) for p in block.parameters() if p.dim() == 2}
    fwd = ElementwiseBytes(shapes)
    with fwd:
        y = _run(mode, lambda: block(x, cos, sin))
    bwd = ElementwiseBytes(shapes)
    with bwd:
        y.backward(torch.randn_like(y))
    return fwd.bytes / (batch * seq), bwd.bytes / (batch * seq)


def adamw_bytes_per_param(numel: int = 1 << 16) -> float:
    """Bytes torch's foreach AdamW moves per fp32 parameter in one step (second step: state exists)."""
    p = torch.nn.Parameter(torch.randn(numel))
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=True)
    p.grad = torch.randn(numel)
    opt.step()
    count = ElementwiseBytes(set())
    with count:
        opt.step()
    return count.bytes / numel


def _op_policy(meta: dict[str, int]) -> Callable[..., CheckpointPolicy]:
    """torchtitan's ``_custom_policy``: save the outputs of :data:`SAC_SAVE` except every second mm."""
    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == aten.mm.default:
            meta[mode] += 1
        save = func in SAC_SAVE and not (func == aten.mm.default and meta[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


class _GemmShapes(TorchDispatchMode):
    """Records the ``(m, n, k)`` of every mm dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, int, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func == aten.mm.default:
            a, b = args[0], args[1]
            self.shapes.append((a.shape[0], b.shape[1], a.shape[1]))
        return func(*args, **(kwargs or {}))


def op_sac_block(cfg: ModelConfig, mode: str, batch: int = 2, seq: int = 64) -> tuple[int, list[tuple[int, int, int]]]:
    """One block under torchtitan's op-level policy: (bytes it keeps for backward: the policy's
    saved outputs plus the checkpoint's input, each storage once; the ``(m, n, k)`` of the mm
    calls backward reruns, in order)."""
    block, x, cos, sin = _block(cfg, mode, batch, seq)
    held: dict[str, Any] = {}

    def context_fn() -> tuple[Any, Any]:
        fwd, rec = create_selective_checkpoint_contexts(_op_policy(defaultdict(int)))
        held["fwd"] = fwd
        return fwd, rec

    y = _run(mode, lambda: checkpoint(block, x, cos, sin, use_reentrant=False, context_fn=context_fn))
    kept = [w.val for outs in held["fwd"].storage.values() for entry in outs.values()
            for w in tree_flatten(entry)[0] if hasattr(w, "val") and isinstance(w.val, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*kept, x]}
    rerun = _GemmShapes()
    with rerun:
        y.backward(torch.randn_like(y))
    forward_gemms = 7  # the mm's backward runs besides the rerun ones: 2 per forward GEMM
    return sum(storages.values()), rerun.shapes[:len(rerun.shapes) - 2 * forward_gemms]


def _partitioner_backend() -> Any:
    """Inductor's partition of a block without its code generation: AOTAutograd with Inductor's
    decompositions and min-cut partitioner, the graphs run eagerly (same saved set, seconds to build)."""
    import functools

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    def nop(gm: Any, _: Any) -> Any:
        return gm

    return aot_autograd(fw_compiler=nop, bw_compiler=nop, decompositions=select_decomp_table(),
                        partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))


def saved_bytes(cfg: ModelConfig, mode: str, backend: str | None = None, batch: int = 2, seq: int = 100) -> int:
    """Bytes one block saves for backward (each storage once; not parameters, their half copies or
    the RoPE tables), eager or compiled with ``backend`` (``"inductor"``, or ``"partitioner"``:
    :func:`_partitioner_backend`). Keep ``batch * seq`` unlike every weight dimension: tensors of a
    weight's shape (or its transpose) are taken for weight copies."""
    block, _, cos, sin = _block(cfg, mode, batch, seq)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()} | {
        t.untyped_storage().data_ptr() for t in (cos, sin)}
    weights = {s for p in block.parameters() for s in (tuple(p.shape), tuple(p.shape)[::-1])}
    fn: Callable[..., torch.Tensor] = block
    if backend is not None:
        fn = torch.compile(block.forward, backend=_partitioner_backend() if backend == "partitioner" else backend)
    for _ in range(2 if backend else 1):  # compiled: measure the second call
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor, seen: dict[int, int] = seen) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in params and tuple(t.shape) not in weights:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = _block(cfg, mode, batch, seq)[1]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = _run(mode, lambda x=x: fn(x, cos, sin))
        y.sum().backward()
    return sum(seen.values())


def step_peak_bytes(flags: list[str]) -> tuple[int, Any]:
    """(peak live tensor bytes of CPU training, its config): every allocation and free from the
    trainer's construction through three steps (the profiler's memory events, recorded in a fresh
    interpreter: a process's later profiling sessions can miss them), so the peak is the steady
    state's (the optimizer's state exists from the first step on)."""
    import json
    import os
    import subprocess
    import sys

    from hybridpar.config import load_config

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, __file__, "--step-peak", json.dumps(flags)], capture_output=True,
                         text=True, check=True, env=env, timeout=600)
    return int(out.stdout.split()[-1]), load_config(None, [*flags, "--train.run_dir", "unused"])


def _profiled_peak(flags: list[str]) -> int:
    """:func:`step_peak_bytes`'s measurement, in this process."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from hybridpar.config import load_config
    from hybridpar.distributed.mesh import ParallelDims
    from hybridpar.training.trainer import Trainer

    cfg = load_config(None, [*flags, "--train.run_dir", tempfile.mkdtemp()])
    with ParallelDims.from_config(cfg.parallel).build("cpu") as topo, \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer = Trainer(cfg, topo)
        for step in (1, 2, 3):
            trainer.train_step(step)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def main() -> None:
    import numpy as np

    widths = [(64, 4, 2, 16, 160), (96, 4, 2, 16, 160), (64, 6, 2, 16, 160), (64, 4, 1, 16, 160),
              (64, 4, 2, 16, 224), (96, 6, 3, 16, 224), (128, 4, 4, 16, 160)]
    rows = [[h, n * d, k * d, f, 1] for h, n, k, d, f in widths]
    for mode in MODES:
        measured = [elementwise_bytes(llama_shape(*w, 250), mode) for w in widths]
        for i, name in enumerate(("forward", "backward")):
            fit = np.linalg.lstsq(np.array(rows, float), np.array([m[i] for m in measured]), rcond=None)[0]
            print(f"{mode:8} {name:8} bytes/token = {fit[0]:.1f} h + {fit[1]:.1f} q + {fit[2]:.1f} kv "
                  f"+ {fit[3]:.1f} f + {fit[4]:.0f}")
    print(f"AdamW (foreach): {adamw_bytes_per_param():.1f} bytes per parameter")


if __name__ == "__main__":
    import json
    import sys

    if sys.argv[1:2] == ["--step-peak"]:
        print(_profiled_peak(json.loads(sys.argv[2])))
    else:
        main()
