"""Every private or semi-private torch API hybridpar relies on, in one place.

Each function wraps one use, says why the public API does not suffice, and names the torch
versions it was checked on; ``tests/test_compat.py`` holds one test per function that asserts the
behaviour the callers depend on, so a torch upgrade that changes any of it fails there first.

This module imports only torch: it sits at the bottom of the package and everything else
(``hybridpar.parallel`` in particular) may import it.

Checked on: torch 2.13.0 (CPU build).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# ----------------------------------------------------------------------------- storage


def storage_ptr_nbytes(t: torch.Tensor) -> tuple[int, int]:
    """``(data pointer, size in bytes)`` of the whole untyped storage behind ``t``.

    Why: two views of one buffer (e.g. ZeRO's per-parameter views of a flat shard) must be
    counted once when measuring memory held; the storage's pointer identifies the buffer and
    its ``nbytes`` is the memory it holds, whatever slice ``t`` covers. A storage freed with
    :func:`free_storage` reports 0 bytes. ``Tensor.untyped_storage()`` is documented but its
    semantics (shared by all views, resizable) are what this relies on.

    Checked on: torch 2.13.0.
    """
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def spans_whole_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` starts at offset 0 of its storage and covers exactly all of its bytes.

    Why: :func:`free_storage` resizes the *storage*, so it may only be applied to a tensor
    for which that storage is its own: a view into a larger buffer (offset, or fewer bytes)
    must be cloned first. This does not detect another tensor viewing the same whole storage.

    Checked on: torch 2.13.0.
    """
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def free_storage(t: torch.Tensor) -> None:
    """Release the memory behind ``t`` while keeping the tensor object, its shape and strides.

    Why: ZeRO-3 frees a gathered parameter after its unit runs, but autograd may have saved
    that very tensor for backward; resizing its storage to zero (instead of dropping the
    tensor) lets :func:`restore_storage` refill it in place before backward reads it. torch
    has no public API for this (FSDP uses the same ``untyped_storage().resize_(0)``). Pass
    ``p.data`` for a parameter so the write is invisible to autograd's version counter.

    Checked on: torch 2.13.0.
    """
    t.untyped_storage().resize_(0)


def restore_storage(t: torch.Tensor) -> None:
    """Give a tensor freed by :func:`free_storage` ``numel * element_size`` bytes again.

    The contents are undefined until written; the caller fills them (e.g. from an
    all-gather). ``t`` must span its whole storage (see :func:`spans_whole_storage`).

    Checked on: torch 2.13.0.
    """
    t.untyped_storage().resize_(t.numel() * t.element_size())


# ----------------------------------------------------------------------------- nn.Module


def set_parameter(module: nn.Module, name: str, p: nn.Parameter) -> None:
    """Make ``p`` the parameter ``name`` of ``module`` by writing ``module._parameters``.

    Why: ZeRO-3 swaps each parameter between its shard and its full tensor twice per unit
    per step. ``setattr``/``register_parameter`` would run nn.Module's checks and any global
    parameter-registration hooks on every swap; the swap only replaces the value of an
    already-registered name, so it writes the dict directly (as FSDP does). ``name`` must
    already be a parameter of ``module``.

    Checked on: torch 2.13.0.
    """
    module._parameters[name] = p


def own_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter | None]]:
    """``(name, parameter)`` registered directly on ``module`` (not its children), in
    registration order, including ``None`` entries and parameters also registered elsewhere.

    Why: ZeRO-3 needs the owning module and attribute of every parameter (to swap it with
    :func:`set_parameter`) and must see every module a shared parameter (a tied head) is
    registered on, to swap it on all of them; ``named_parameters()`` drops duplicates by default.

    Checked on: torch 2.13.0.
    """
    return list(module._parameters.items())


# ----------------------------------------------------------------------------- DTensor


def dtensor_like(local: torch.Tensor, like: Any) -> Any:
    """A DTensor with the mesh, placements and global shape of DTensor ``like`` around ``local``
    (this rank's piece, same shape as ``like.to_local()``), kept where it is.

    Why: the background checkpoint writer stages a copy of each piece in host memory and hands
    DCP DTensors of those copies (DCP needs the placements to know where each piece goes).
    ``DTensor.from_local`` moves the piece to the mesh's device, which would put a GPU run's
    host copy back on the GPU; the DTensor constructor with ``like``'s spec (what DCP's own
    staging does) keeps it. No communication either way.

    Checked on: torch 2.13.0.
    """
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)


# ----------------------------------------------------------------------------- kernels


def flash_attention_cpu(namespace: Any = None) -> tuple[Any, Any] | None:
    """The fused CPU attention kernel behind ``F.scaled_dot_product_attention`` and its
    backward, ``(aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward)``, or ``None`` when this torch
    lacks either. Why: ring attention needs the per-row log-sum-exp of each block (to merge blocks) and a
    backward that takes the final merged output and log-sum-exp; the public
    ``scaled_dot_product_attention`` exposes neither. Signatures relied on::

        fwd(q, k, v, dropout_p, is_causal, *, scale) -> (out, logsumexp)   # native GQA
        bwd(dout, q, k, v, out, logsumexp, dropout_p, is_causal, *, scale) -> (dq, dk, dv)

    ``namespace`` defaults to ``torch.ops.aten`` (another object can be passed in tests).

    Checked on: torch 2.13.0.
    """
    ops = torch.ops.aten if namespace is None else namespace
    fwd = getattr(ops, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(ops, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is None or bwd is None:
        return None
    return fwd, bwd


def cpu_fused_attention_runs(q: torch.Tensor) -> bool:
    """Whether torch's fused CPU attention kernel runs for ``q``'s dtype on this CPU: in torch
    2.13 its bf16/fp16 path packs operands with an AVX-512-only routine and raises ("pack_vnni2 is
    only supported when avx512 is supported") wherever the kernels run below AVX-512 (an AVX2
    CPU, or ``ATEN_CPU_CAPABILITY=default|avx2``). fp32 runs everywhere.

    Checked on: torch 2.13.0."""
    if q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16):
        return True
    return torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512")


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                                 attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, on the math backend where the fused CPU kernel does not
    run (:func:`cpu_fused_attention_runs`: bf16/fp16 below AVX-512), so low-precision CPU training
    works on every CPU; the same function of the inputs, computed unfused."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    if cpu_fused_attention_runs(q):
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)
    with sdpa_kernel(SDPBackend.MATH):
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (``_grouped_mm``'s CPU
    backward rejects expanded gradients such as the one of ``y.sum()``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return dy.contiguous()


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``cat([x_e @ w[e].T for each expert e])`` where ``x_e`` are the next ``counts[e]`` rows of
    ``x [N, in]`` (rows sorted by expert) and ``w [E, out, in]``: the experts' matmul in one call.

    Why private: ``torch._grouped_mm`` (one kernel for all experts, variable group sizes, with
    autograd) has no public equivalent. Where this torch lacks it or rejects the inputs (dtype,
    device), a loop over the non-empty segments computes the same products.

    Checked on: torch 2.13.0 (CPU: fp32 and bf16, forward and backward).
    """
    if len(counts) != w.shape[0]:
        raise ValueError(f"grouped_mm: {len(counts)} group sizes for {w.shape[0]} experts")
    fn = getattr(torch, "_grouped_mm", None)
    if fn is not None and x.shape[0] > 0 and x.dtype == w.dtype:
        offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(x.device)
        try:
            return _ContiguousGrad.apply(fn(x, w.transpose(-2, -1), offs=offsets))
        except (RuntimeError, NotImplementedError):
            pass
    return grouped_mm_loop(x, w, counts)


def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The reference (and fallback) of :func:`grouped_mm`: one matmul per non-empty segment."""
    parts, start = [], 0
    for e, n in enumerate(counts):
        if n:
            parts.append(x[start:start + n] @ w[e].transpose(0, 1))
        start += n
    if not parts:
        # keep the graph to w and to x: a rank whose experts got no rows must still run the
        # backward of the all-to-all that delivered them (its peers wait in it)
        return x.new_zeros((0, w.shape[1])) + 0 * w.sum() + 0 * x.sum()
    return torch.cat(parts)


def in_backward() -> bool:
    """Whether autograd is running a backward pass now (e.g. recomputing a checkpointed
    forward), so statistics recorded in a forward are not counted twice.

    Why private: ``torch._C._current_graph_task_id`` is the only way to ask; -1 outside backward.

    Checked on: torch 2.13.0.
    """
    return torch._C._current_graph_task_id() != -1


def saved_tensor_hooks_active() -> bool:
    """Whether a ``torch.autograd.graph.saved_tensors_hooks`` context (e.g. the one
    ``torch.utils.checkpoint`` opens around a block's forward) is active on this thread, so
    tensors autograd saves now go through its pack hook instead of being kept as they are.

    Why private: ``torch._C._autograd._top_saved_tensors_default_hooks`` is the only way to ask;
    the public context manager has no query. The W split (``parallel/pipeline/wsplit``) skips its
    own pack hooks, one Python call per saved tensor, where none are needed.

    Checked on: torch 2.13.0.
    """
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def will_engine_execute(node: Any) -> bool:
    """Whether the running backward will execute autograd ``node`` (a non-leaf node: the
    engine refuses the question for a leaf's AccumulateGrad under ``autograd.grad``). The FP8
    linear (``parallel/fp8``) asks it for its input and weight edges, so that the zero-bubble
    split's B (``autograd.grad`` of the input) runs only the input-gradient GEMM and its W
    (``backward(inputs=params)``) only the weight-gradient GEMM, where ``ctx.needs_input_grad``
    is fixed at forward time and would run both twice.

    Why private: ``torch._C._will_engine_execute_node`` is the only way to ask (``torch.autograd.
    graph`` uses it for its multi-grad hooks). Outside ``inputs=``-restricted runs it is True.

    Checked on: torch 2.13.0.
    """
    return bool(torch._C._will_engine_execute_node(node))


#: CPU FP8 GEMMs: False (default) runs :func:`scaled_mm` as an fp32 GEMM of the dequantized
#: operands, True runs torch's ``_scaled_mm`` CPU kernel (the tests check both agree)
CPU_SCALED_MM_KERNEL = False


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)`` in ``out_dtype`` for FP8 ``a [M, K]`` (row-major) and
    ``b [K, N]`` (column-major), accumulated in fp32: ``torch._scaled_mm``, the only FP8 GEMM in
    torch (``parallel/fp8`` is its one caller). Scales are fp32 dequantization factors: 0-dim
    (tensorwise) or ``[M, 1]`` and ``[1, N]`` (rowwise).

    What it accepts, tried on torch 2.13.0 CPU: e4m3 x e4m3, e5m2 x e4m3, e4m3 x e5m2 and
    e5m2 x e5m2, tensorwise and rowwise, bf16 or fp32 output (the default output is the FP8
    dtype itself, never wanted here), any strides. CUDA (capability >= 8.9) is narrower: ``b``
    column-major, not e5m2 x e5m2, and rowwise scaling only with e4m3 operands and a bf16
    output, so a rowwise fp32 result is computed in bf16 there and widened.

    On the CPU, torch's kernel is a slow reference (measured on this 2-core machine, torch 2.13:
    a ``[256, 128] @ [128, 384]`` product takes ~1 s tensorwise and ~0.09 s rowwise, against
    0.02 s for an fp32 GEMM), so by default (:data:`CPU_SCALED_MM_KERNEL` False) the same product
    is computed as an fp32 GEMM of the dequantized operands: FP8 values and their products are
    exact in fp32 and the scales are powers of two (``parallel/fp8``), so this is the same
    arithmetic with fp32 accumulation, in another summation order (``tests/test_fp8.py`` holds
    both to the same float64 bound).

    Why private: FP8 matmuls have no public API in torch 2.13 (torchao wraps the same op).

    Checked on: torch 2.13.0 (CPU); the CUDA constraints from torch's ``_scaled_mm`` checks.
    """
    if a.device.type == "cpu" and not CPU_SCALED_MM_KERNEL:
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)
    rowwise = scale_a.numel() > 1 or scale_b.numel() > 1
    if a.device.type == "cuda" and rowwise and out_dtype != torch.bfloat16:
        return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16).to(out_dtype)
    return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)


# ----------------------------------------------------------------------------- launcher


def launch_config(cls: Any, newer: dict[str, Any], **fields: Any) -> tuple[Any, list[str]]:
    """``cls(**fields, **newer)`` (``cls``: torch's ``LaunchConfig``) without the ``newer`` fields
    this torch's ``cls`` lacks; returns it and the names left out. Why: ``LaunchConfig`` grows
    fields between releases (``shutdown_timeout``, how long the agent waits for signalled workers,
    is on 2.13, not 2.11, which waits 30 s): its fields, not a version number, decide.
    Checked on: torch 2.13.0 (has shutdown_timeout); a LaunchConfig without it (tests)."""
    import dataclasses
    import inspect

    names = ({f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls)
             else set(inspect.signature(cls).parameters))
    kept = {k: v for k, v in newer.items() if k in names}
    return cls(**fields, **kept), [k for k in newer if k not in kept]


@contextlib.contextmanager
def watch_worker_failures(callback: Any) -> Iterator[None]:
    """While inside, call ``callback(failed, restarts_left)`` each time torch's local elastic agent
    finds failed workers: ``failed`` maps global rank -> exit code (negative: killed by that
    signal), ``restarts_left`` the restarts the agent still has (it restarts when > 0).

    Why private: under ``max_restarts`` the agent restarts a failed worker group and only logs
    it; ``LocalElasticAgent._monitor_workers``, whose ``RunResult.failures`` name each failed rank
    and its exit code, is the one place that knows which rank died and how. The agent's
    ``_remaining_restarts`` is its count of restarts left.

    Checked on: torch 2.13.0.
    """
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = LocalElasticAgent._monitor_workers

    def monitored(self: Any, worker_group: Any) -> Any:
        result = original(self, worker_group)
        if getattr(result, "failures", None):
            callback({rank: f.exitcode for rank, f in result.failures.items()},
                     int(getattr(self, "_remaining_restarts", 0)))
        return result

    LocalElasticAgent._monitor_workers = monitored
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = original


# ----------------------------------------------------------------------------- optimizers


def fused_optimizer_devices() -> frozenset[str]:
    """The device types torch's fused optimizer kernels run on (``fused=True`` of ``Adam``,
    ``AdamW``, ``SGD``, ``Adagrad``): ZeRO picks them by default where they apply.

    Why private: ``torch.optim.optimizer._get_fused_kernels_supported_devices`` is the list the
    optimizers check ``fused=True`` against; torch has no public query, and constructing an
    optimizer to find out would only fail at its first step.

    Checked on: torch 2.13.0 (cpu and cuda among them).
    """
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return frozenset(_get_fused_kernels_supported_devices())


# ----------------------------------------------------------------------------- torch.compile


@dataclass(frozen=True)
class CompileStats:
    """What ``torch.compile`` did in this process so far: ``seconds`` compiling (dynamo's frame
    compiles plus AOT backward compiles), ``graphs`` captured and ``graph_breaks``."""

    seconds: float
    graphs: int
    graph_breaks: int


def compile_stats() -> CompileStats:
    """This process's compile time, graph and graph-break counts (``train.compile`` reports them).

    Why private: ``torch._dynamo.utils.calculate_time_spent`` and ``counters`` are what
    ``TORCH_LOGS`` and ``torch._dynamo.utils.compile_times`` print; torch has no public API for
    the numbers.

    Checked on: torch 2.13.0.
    """
    from torch._dynamo import utils

    spent = utils.calculate_time_spent()
    return CompileStats(seconds=float(spent.get("total_wall_time", 0.0)),
                        graphs=int(utils.counters["stats"]["unique_graphs"]),
                        graph_breaks=int(sum(utils.counters["graph_break"].values())))


# ----------------------------------------------------------------------------- multi-tensor kernels


def group_by_device_dtype(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """``tensors`` grouped by (device, dtype), in order: a ``torch._foreach_*`` kernel takes one
    group per launch. (``torch.utils._foreach_utils`` groups too, but is private and keyed
    differently across versions.)"""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def foreach_mul_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every tensor in place by the 0-d tensor ``factor`` (cast to each group's device
    and dtype) without reading it: ``torch._foreach_mul_`` (private), one kernel per group."""
    for (device, dtype), group in group_by_device_dtype(tensors).items():
        torch._foreach_mul_(group, factor.to(device, dtype))


# ----------------------------------------------------------------------------- fake tensors, fake process group
# The dry run (hybridpar.training.dryrun) trains a real-size rank on these; all checked on torch 2.13.0.


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode`` (tensors with shape, dtype and device, no storage) that accepts real
    inputs too. Why private: fake tensors live only in ``torch._subclasses``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def real_tensors() -> contextlib.AbstractContextManager[Any]:
    """Suspend an active fake-tensor mode (a no-op without one), for host-side planning on small
    tensors whose values are read. Why private: ``torch._subclasses.fake_tensor``."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor, whose values a host-side check cannot read."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def init_fake_process_group(rank: int, world_size: int) -> None:
    """The default process group as torch's fake one: collectives keep shapes and move nothing,
    so this process plays ``rank`` of ``world_size``. Why private: the backend registers itself
    on import of ``torch.testing._internal.distributed.fake_pg``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def work_completed(work: Any) -> bool:
    """Whether a ``dist.Work`` has completed, without blocking. The fake process group's
    ``FakeWork`` (private) moves nothing yet never says it completed, even after ``wait()``: the
    dry run's pipeline (``Pending.done``) would keep every sent activation to the step's end."""
    return type(work).__name__ == "FakeWork" or work.is_completed()


def flop_counter() -> Any:
    """torch's ``FlopCounterMode``, counting :func:`flash_attention_cpu`'s kernels as it counts the
    GPU's flash kernels (forward 2 matmuls, backward 5 with the scores recomputed; GQA included),
    and without its module tracker, whose hooks keep a checkpointed block's forward tensors alive
    (the dry run's full-recompute peak was 21% high). Why here: ``mod_tracker`` is undocumented."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    def forward(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:  # noqa: ARG001
        return sdpa_flop_count(q, k, v)

    def backward(dout: Any, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:  # noqa: ARG001
        return sdpa_backward_flop_count(dout, q, k, v)

    kernels = flash_attention_cpu()  # none: no entries
    counter = FlopCounterMode(display=False, custom_mapping=dict(zip(kernels or (), (forward, backward), strict=False)))
    counter.mod_tracker = _NoModules()
    return counter


class _NoModules(contextlib.nullcontext):  # flop_counter's module tracker: every count is global
    parents = frozenset({"Global"})
