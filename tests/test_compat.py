"""One test per private torch API wrapped in :mod:`hybridpar.compat`: each asserts the behaviour
its caller relies on, on the installed torch, so an upgrade that changes it fails here first."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridpar import compat

# ----------------------------------------------------------------------------- storage


def test_storage_ptr_nbytes_identifies_the_shared_buffer():
    flat = torch.zeros(10)
    a, b = flat[:4], flat[4:]
    ptr_a, n_a = compat.storage_ptr_nbytes(a)
    ptr_b, n_b = compat.storage_ptr_nbytes(b)
    assert ptr_a == ptr_b == flat.data_ptr()  # views of one buffer: one storage, counted once
    assert n_a == n_b == 10 * 4  # the whole buffer's bytes, not the view's
    other_ptr, _ = compat.storage_ptr_nbytes(torch.zeros(10))
    assert other_ptr != ptr_a
    t = torch.ones(6)
    compat.free_storage(t)
    assert compat.storage_ptr_nbytes(t)[1] == 0  # a freed storage holds no memory


def test_spans_whole_storage():
    flat = torch.zeros(12)
    assert compat.spans_whole_storage(flat)
    assert compat.spans_whole_storage(flat.view(3, 4))
    assert not compat.spans_whole_storage(flat[2:])  # offset
    assert not compat.spans_whole_storage(flat[:6])  # fewer bytes than the storage
    assert compat.spans_whole_storage(flat[:6].clone())
    assert compat.spans_whole_storage(nn.Parameter(torch.zeros(3, 2, dtype=torch.bfloat16)))


def test_free_then_restore_storage_keeps_the_tensor_and_refills_in_place():
    p = nn.Parameter(torch.arange(12, dtype=torch.float32).view(3, 4))
    obj, shape, stride = id(p), p.shape, p.stride()
    compat.free_storage(p.data)
    assert id(p) == obj and p.shape == shape and p.stride() == stride
    assert p.untyped_storage().nbytes() == 0
    compat.restore_storage(p.data)
    assert id(p) == obj and p.shape == shape and p.stride() == stride
    assert p.untyped_storage().nbytes() == p.numel() * p.element_size() == 48
    p.data.copy_(torch.full((3, 4), 7.0))  # writable, and visible through the parameter
    assert torch.equal(p.detach(), torch.full((3, 4), 7.0))


def test_freed_tensor_saved_by_autograd_is_refilled_before_backward():
    """ZeRO-3's reason for resizing storage instead of dropping the tensor: a tensor autograd
    saved in forward, freed and then refilled through ``.data``, is read back in backward with
    the new contents and without a version-counter error."""
    w = nn.Parameter(torch.full((4,), 2.0))
    x = torch.ones(4, requires_grad=True)
    y = (x * w).sum()  # saves w for x's gradient
    version = w._version
    compat.free_storage(w.data)
    compat.restore_storage(w.data)
    w.data.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert w._version == version  # writes through .data are invisible to autograd
    y.backward()
    assert torch.equal(x.grad, torch.tensor([1.0, 2.0, 3.0, 4.0]))


# ----------------------------------------------------------------------------- nn.Module


def test_set_parameter_swaps_without_registration_side_effects():
    lin = nn.Linear(3, 2)
    calls: list[str] = []
    handle = torch.nn.modules.module.register_module_parameter_registration_hook(
        lambda module, name, param: calls.append(name))
    try:
        lin.bias = nn.Parameter(torch.zeros(2))  # the public path, for contrast
        assert calls == ["bias"]
        calls.clear()
        new = nn.Parameter(torch.ones(5))  # another shape: a ZeRO-3 shard is not the full size
        compat.set_parameter(lin, "weight", new)
    finally:
        handle.remove()
    assert calls == []  # no global registration hook ran
    assert lin.weight is new
    assert [n for n, _ in lin.named_parameters()] == ["weight", "bias"]  # order kept
    assert dict(lin.named_parameters())["weight"] is new
    assert "weight" not in lin.__dict__


def test_own_parameters_sees_none_entries_and_shared_parameters():
    shared = nn.Parameter(torch.zeros(2))
    root = nn.Module()
    root.a, root.b = nn.Module(), nn.Module()
    root.a.w = shared
    root.b.w = shared
    root.b.register_parameter("bias", None)
    root.top = nn.Parameter(torch.zeros(1))
    assert compat.own_parameters(root) == [("top", root.top)]  # not the children's
    assert compat.own_parameters(root.a) == [("w", shared)]
    assert compat.own_parameters(root.b) == [("w", shared), ("bias", None)]
    # named_parameters() would hide the second registration ZeRO-3 must refuse
    assert [n for n, _ in root.named_parameters()] == ["top", "a.w"]


# ----------------------------------------------------------------------------- kernels


def test_flash_attention_cpu_returns_none_without_the_ops():
    assert compat.flash_attention_cpu(types.SimpleNamespace()) is None
    fwd_only = types.SimpleNamespace(_scaled_dot_product_flash_attention_for_cpu=object())
    assert compat.flash_attention_cpu(fwd_only) is None


def _rounding_bound(magnitude: torch.Tensor, roundings: int) -> float:
    """Worst-case fp32 error of a result of ``magnitude``: ``roundings`` roundings along its
    longest chain, each at most eps relative to the running value (Higham's gamma_n bound for an
    n-term sum, applied to sums of O(1) terms whose running values stay within the result's
    magnitude)."""
    return roundings * torch.finfo(torch.float32).eps * float(magnitude.detach().abs().max())


def test_flash_attention_cpu_matches_sdpa_and_autograd():
    ops = compat.flash_attention_cpu()
    if ops is None:  # this torch lacks the kernel: the wrapper says so and ring attention uses matmuls
        assert not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu") or \
            not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")
        pytest.skip("no fused CPU flash attention in this torch")
    fwd, bwd = ops
    b, h, hk, n, d = 2, 4, 2, 48, 16  # GQA: two query heads per kv head, as ring attention uses
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(b, x, n, d, generator=g) for x in (h, hk, hk, h))
    scale = d ** -0.5

    out, lse = fwd(q, k, v, 0.0, True, scale=scale)
    dq, dk, dv = bwd(dout, q, k, v, out, lse, 0.0, True, scale=scale)

    # reference: the public op and autograd in float64 (its own rounding is ~1e-16, negligible)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True, scale=scale, enable_gqa=True)
    ref.backward(dout.double())
    scores = q64.detach() @ k64.detach().repeat_interleave(h // hk, 1).transpose(-1, -2) * scale
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    lse_ref = torch.logsumexp(scores.masked_fill(~causal, float("-inf")), dim=-1)

    # forward chain: scores (d-term dot) -> max/exp/sum over n keys -> divide -> P.V over n keys
    tol_out = _rounding_bound(ref, d + 2 * n + 4)
    # backward chain: scores (d) and P from lse (2), dP = dO.V (d), delta (d), dS (2), then the
    # final sum over n keys per query head, times h/hk query heads per kv head for dK and dV
    tol_grad = 3 * d + 4 + (h // hk) * n
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == (b, h, n)
    assert (out.double() - ref.detach()).abs().max() <= tol_out
    assert (lse.double() - lse_ref).abs().max() <= _rounding_bound(lse_ref, d + n + 2)
    for got, want in ((dq, q64.grad), (dk, k64.grad), (dv, v64.grad)):
        assert got.shape == want.shape
        assert (got.double() - want).abs().max() <= _rounding_bound(want, tol_grad)

    # the tolerance is far tighter than a wrong kernel call: without the causal mask it fails
    wrong, _ = fwd(q, k, v, 0.0, False, scale=scale)
    assert (wrong.double() - ref.detach()).abs().max() > 100 * tol_out


# ----------------------------------------------------------------------------- DTensor


def _dtensor_like_on_rank(rank: int, world: int) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    live = DTensor.from_local(torch.arange(6.0).view(2, 3) + 6 * rank, mesh, [Shard(0)], run_check=False)
    copy = live.to_local().clone()
    staged = compat.dtensor_like(copy, live)
    assert isinstance(staged, DTensor) and staged.to_local().data_ptr() == copy.data_ptr()  # kept, not copied
    assert staged.device_mesh is mesh and staged.placements == live.placements and staged.shape == live.shape
    live.to_local().add_(100)  # the live piece moves on; the staged one does not
    assert torch.equal(staged.full_tensor(), torch.arange(6.0 * world).view(2 * world, 3))
    return True


def test_dtensor_like_wraps_a_copy_with_the_same_placements(dist_run):
    assert dist_run(2, _dtensor_like_on_rank) == [True, True]


def test_saved_tensor_hooks_active_sees_checkpoint_and_explicit_hooks():
    from torch.utils.checkpoint import checkpoint

    from hybridpar.compat import saved_tensor_hooks_active

    seen = []

    def block(x: torch.Tensor) -> torch.Tensor:
        seen.append(saved_tensor_hooks_active())
        return x.sin()

    assert not saved_tensor_hooks_active()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert saved_tensor_hooks_active()
    assert not saved_tensor_hooks_active()
    checkpoint(block, torch.ones(3, requires_grad=True), use_reentrant=False).sum().backward()
    block(torch.ones(3))
    assert seen == [True, True, False]  # forward and recomputation under checkpoint, then plain


# ----------------------------------------------------------------------------- torch.compile


def test_compile_stats_count_graphs_breaks_and_time():
    torch.compiler.reset()
    before = compat.compile_stats()

    def f(x):
        y = torch.sin(x) * 2
        torch._dynamo.graph_break()  # one break: two graphs
        return y + 1

    g = torch.compile(f, backend="aot_eager")
    x = torch.randn(4, requires_grad=True)
    g(x).sum().backward()
    after = compat.compile_stats()
    assert after.graphs - before.graphs == 2
    assert after.graph_breaks - before.graph_breaks == 1
    assert after.seconds > before.seconds


# ----------------------------------------------------------------------------- launcher


def test_launch_config_leaves_out_fields_an_older_torch_lacks():
    """torch 2.11's LaunchConfig has no shutdown_timeout (``hybridpar train --nproc N`` failed
    there with a TypeError): the launcher's config is built against one without it."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    from hybridpar.distributed.launch import SHUTDOWN_TIMEOUT_S, Rendezvous, launch_config

    fields = [(f.name, f.type, f) for f in dataclasses.fields(LaunchConfig) if f.name != "shutdown_timeout"]
    Older = dataclasses.make_dataclass("LaunchConfig", fields)
    with pytest.raises(TypeError, match="shutdown_timeout"):
        Older(min_nodes=1, max_nodes=1, nproc_per_node=2, shutdown_timeout=1)
    rdzv = Rendezvous(run_id="r")
    old = launch_config(Older, 2, rdzv, max_restarts=3)
    assert (old.nproc_per_node, old.max_restarts, old.run_id, old.start_method) == (2, 3, "r", "spawn")
    assert not hasattr(old, "shutdown_timeout")
    new = launch_config(LaunchConfig, 2, rdzv, max_restarts=3)  # this torch (2.13) has the field
    assert new.shutdown_timeout == SHUTDOWN_TIMEOUT_S and new.nproc_per_node == 2
    config, left_out = compat.launch_config(Older, {"shutdown_timeout": 5}, min_nodes=1, max_nodes=1, nproc_per_node=1)
    assert left_out == ["shutdown_timeout"] and config.nproc_per_node == 1


def test_watch_worker_failures_sees_the_agents_failed_ranks(monkeypatch):
    """The agent's monitor result names failed global ranks with exit codes, and the agent
    counts its restarts left in ``_remaining_restarts``: the hook reports both, and restores."""
    import inspect

    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    assert "failures" in inspect.signature(api.RunResult).parameters
    assert "self._remaining_restarts" in inspect.getsource(api.SimpleElasticAgent)
    result = api.RunResult(state=api.WorkerState.FAILED, failures={1: types.SimpleNamespace(exitcode=-9)})
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda self, group: result)
    seen = []
    with compat.watch_worker_failures(lambda failed, left: seen.append((failed, left))):
        assert LocalElasticAgent._monitor_workers(types.SimpleNamespace(_remaining_restarts=2), None) is result
    assert seen == [({1: -9}, 2)]
    assert LocalElasticAgent._monitor_workers(None, None) is result  # the original is back


def test_fused_optimizer_devices_include_cpu_and_cuda_and_fused_adamw_runs_on_cpu():
    """ZeRO's default kernel choice relies on the list naming cpu and cuda, and on the fused
    CPU kernel stepping float32 and bfloat16 tensors."""
    assert {"cpu", "cuda"} <= compat.fused_optimizer_devices()
    for dtype in (torch.float32, torch.bfloat16):
        p = nn.Parameter(torch.ones(3, dtype=dtype))
        p.grad = torch.ones(3, dtype=dtype)
        torch.optim.AdamW([p], lr=0.5, fused=True).step()
        assert torch.all(p < 1)


# ----------------------------------------------------------------------------- multi-tensor kernels


def test_group_by_device_dtype_keeps_order_within_groups():
    a, b, c = torch.ones(2), torch.ones(3, dtype=torch.bfloat16), torch.ones(4)
    groups = compat.group_by_device_dtype([a, b, c])
    assert list(groups) == [(a.device, torch.float32), (b.device, torch.bfloat16)]
    assert groups[(a.device, torch.float32)][0] is a and groups[(a.device, torch.float32)][1] is c


def test_foreach_mul_scales_in_place_like_mul_per_tensor():
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(33, generator=gen), torch.randn(4, 5, generator=gen).bfloat16(), torch.randn(17, generator=gen)[3:]]
    expected = [t.clone() for t in tensors]
    factor = torch.tensor(0.37)
    for t in expected:
        t.mul_(factor.to(t.dtype))
    compat.foreach_mul_(tensors, factor)
    for t, e in zip(tensors, expected, strict=True):
        assert torch.equal(t, e)  # bit-equal: clipping by either gives the same weights


@pytest.mark.parametrize("kernel", [True, False])
def test_scaled_mm_takes_what_the_fp8_linear_passes(kernel, monkeypatch):
    """e4m3 x e4m3 and e5m2 x e4m3, tensorwise and rowwise scales, bf16 and fp32 out; with
    power-of-two scales the fp32 result is the exact product (small integers: no rounding)."""
    monkeypatch.setattr(compat, "CPU_SCALED_MM_KERNEL", kernel)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randint(-8, 8, (16, 32), generator=gen).float(), torch.randint(-8, 8, (48, 32), generator=gen).float()
    exact = (a.double() / 4) @ (b.double() * 2).t()
    for left in (torch.float8_e4m3fn, torch.float8_e5m2):
        for sa, sb in ((torch.tensor(0.25), torch.tensor(2.0)), (torch.full((16, 1), 0.25), torch.full((1, 48), 2.0))):
            for out in (torch.float32, torch.bfloat16):
                y = compat.scaled_mm(a.to(left), b.to(torch.float8_e4m3fn).t(), sa, sb, out)
                assert y.dtype == out and torch.equal(y.double(), exact.to(out).double())


def test_will_engine_execute_tells_which_branch_a_backward_needs():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return x * w

        @staticmethod
        def backward(ctx, g):
            seen.append(tuple(compat.will_engine_execute(ctx.next_functions[i][0]) for i in (0, 1)))
            return g, g

    x, w = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    y = Probe.apply(x * 1, w * 1)  # non-leaf inputs: the engine is asked about their nodes
    torch.autograd.grad(y.sum(), x, retain_graph=True)
    y.sum().backward(inputs=[w], retain_graph=True)
    y.sum().backward()
    assert seen == [(True, False), (False, True), (True, True)]


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_attention_runs_on_every_cpu(dtype):
    """bf16/fp16 attention (causal, GQA and with a mask) forward and backward on whatever CPU
    capability the run has: below AVX-512 torch 2.13's fused kernel raises, and the math backend
    takes over. Compared with fp32 attention of the same inputs within the dtype's rounding (a
    few units of its epsilon on outputs of magnitude <= 1)."""
    from hybridpar.compat import scaled_dot_product_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, s, 32, 16, generator=gen) for s in (4, 2, 2))
    mask = torch.ones(32, 32, dtype=torch.bool).tril()
    for kwargs in ({"is_causal": True}, {"attn_mask": mask}):
        low = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = scaled_dot_product_attention(*low, enable_gqa=True, **kwargs)
        out.float().sum().backward()
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
        eps = torch.finfo(dtype).eps
        assert (out.float() - ref).abs().max() <= 8 * eps * ref.abs().max().clamp(min=1)
        assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in low)


def test_fake_tensor_mode_keeps_shapes_without_data_and_real_tensors_suspends_it():
    """Under the mode tensors are fake (shape, dtype, no values; a host read raises) and real
    inputs are accepted; inside real_tensors() the values are real again."""
    real = torch.arange(4.0)
    with compat.fake_tensor_mode():
        x = torch.ones(3, 5) @ torch.ones(5, 2) + real[:2]
        assert compat.is_fake(x) and x.shape == (3, 2) and not compat.is_fake(real)
        with pytest.raises(Exception, match="DataDependent|local_scalar_dense"):
            x.sum().item()
        with compat.real_tensors():
            y = torch.ones(2).sum()
            assert not compat.is_fake(y) and y.item() == 2.0


def test_fake_process_group_plays_any_rank_of_a_large_world():
    """Rank 5 of 16,384: collectives keep shapes and move nothing; groups build."""
    import torch.distributed as dist

    compat.init_fake_process_group(5, 16384)
    try:
        assert dist.get_rank() == 5 and dist.get_world_size() == 16384
        g = dist.new_group(list(range(8)))
        t = torch.ones(3)
        dist.all_reduce(t, group=g)
        out = [torch.empty(3) for _ in range(8)]
        dist.all_gather(out, t, group=g)
        assert t.tolist() == [1.0, 1.0, 1.0] and len(out) == 8
    finally:
        dist.destroy_process_group()


def test_flop_counter_counts_the_cpu_flash_kernel_as_sdpa():
    """The fused CPU kernel's forward and backward FLOPs, as torch counts the GPU's flash kernel
    (forward 2 matmuls, backward 5: the scores recomputed), GQA included."""
    b, h, kv, s, d = 2, 4, 2, 16, 8
    q = torch.randn(b, h, s, d, requires_grad=True)
    k, v = (torch.randn(b, kv, s, d, requires_grad=True) for _ in range(2))
    counter = compat.flop_counter()
    with counter:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    assert counter.get_total_flops() == 7 * 2 * b * h * s * s * d
