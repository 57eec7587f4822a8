"""``hybridpar calibrate``: measure this machine and write a hardware profile for the planner.

The cost model (:mod:`hybridpar.planner.price.cost`) divides work by rates. For a datasheet GPU those
rates are peak x efficiency; here they are measured, on the device and backend training will
use, one process per device (on CPU: one process per core, ``torch.set_num_threads(1)``, the way
the launcher runs ranks):

* GEMM rate by shape: ``[m, k] @ [k, n]`` in the training matmul dtype (fp32 on CPU, bf16 on
  CUDA) on a full grid of log-spaced shapes; the cost model interpolates between them, so thin
  tensor-parallel shards and small micro-batches are priced by what this machine does with
  them, overheads included;
* causal scaled-dot-product attention, forward and backward, by (sequence, head dim);
* element-wise bandwidth (products of activation-sized tensors streamed from a pool larger than
  the caches), the fixed cost of one small op, and of one eager Llama block at a tiny shape
  (kernel dispatch, autograd and module overhead per layer); these compute probes take their
  operands from a pool larger than the caches and are timed in interleaved passes
  (:mod:`hybridpar.planner.machine.probes` says why);
* on CPU, how much each rank slows when all ranks compute at once (shared caches, memory
  bandwidth, sometimes a shared physical core), alone and together alternating, the other
  ranks busy for all of rank 0's timed batch;
* collectives (all-reduce, all-gather, reduce-scatter) for each axis size 2, 4, ... up to
  ``--nproc`` and p2p send/recv, through :class:`hybridpar.distributed.comm.Comm` on the
  backend training uses (gloo on CPU, NCCL on GPUs), fitted as ``alpha + beta * payload bytes``;
  the latency ``alpha`` is the larger of the back-to-back value and the one seen when each call
  follows a few milliseconds of compute, as in training (a rank that waited has to wake up).

The profile is a TOML file (plain data; :func:`hybridpar.planner.machine.hardware.load_gpu_toml` reads
it with the standard ``tomllib``): a ``[gpu]`` table of :class:`GPUSpec` constants derived from
the measurements, and a ``[calibration]`` table of the measured tables. ``hybridpar plan --gpu
FILE`` and ``hybridpar train --parallel.auto true`` (``train.hardware``, or the default file
:func:`hybridpar.planner.machine.profile.default_profile_path`) use it.
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridpar.distributed import device as devices
from hybridpar.distributed.comm import Comm
from hybridpar.distributed.mesh import Axis
from hybridpar.distributed.spawn import run_ranks
from hybridpar.errors import UserError
from hybridpar.planner.machine.hardware import GB, load_gpu_toml
from hybridpar.planner.machine.probes import (
    ComputeRates,
    Plan,
    batch_time,
    cold_pool,
    in_turn,
    measure_compute,
    median_per_call,
    pool_views,
    reps_for,
)
from hybridpar.planner.machine.profile import to_toml, usable_cores


class CalibrateError(UserError):
    """``hybridpar calibrate`` cannot measure what was asked (bad --nproc, no such device)."""


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``t = alpha + beta * bytes`` in relative error (each point weighs 1/t^2),
    clamped to non-negative terms."""
    w = [1.0 / (t * t) for _, t in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points, strict=True))
    sy = sum(wi * t for wi, (_, t) in zip(w, points, strict=True))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points, strict=True))
    sxy = sum(wi * x * t for wi, (x, t) in zip(w, points, strict=True))
    det = sw * sxx - sx * sx
    beta = (sw * sxy - sx * sy) / det if det > 0 else 0.0
    beta = max(beta, 0.0)
    alpha = max((sy - beta * sx) / sw, 0.0)
    return alpha, beta


def _concurrency(rank: int, sizes: list[int], min_time_s: float, batches: int) -> list[tuple[float, float, float]]:
    """``(k, GEMM fraction, element-wise fraction)``: rank 0's rate while ranks ``0..k-1`` all
    compute, over its rate computing alone (CPU ranks share caches, memory bandwidth and maybe a
    physical core). Alone and together alternate ``batches`` times and the medians are compared,
    so a neighbour's load that comes and goes affects both sides alike."""
    import torch.distributed as dist

    cpu = torch.device("cpu")
    pool = cold_pool(cpu, torch.float32)
    gemm = in_turn(pool_views(pool, (512, 512), (512, 512)), torch.mm)
    stream = in_turn(pool_views(pool, (1 << 18,), (1 << 18,)), torch.mul)

    rows = []
    for k in sizes:
        fractions = []
        for fn in (gemm, stream):
            reps = reps_for(fn, cpu, min_time_s)
            alone, together = [], []
            for _ in range(batches):
                for busy, out in ((1, alone), (k, together)):  # each phase starts together
                    dist.barrier()
                    if rank == 0:  # a settling batch after the wake-up from the barrier, then the timed one
                        batch_time(fn, cpu, max(1, reps // 4))
                        out.append(batch_time(fn, cpu, reps))
                    elif rank < busy:  # outlast rank 0's batches, so all of them run beside these
                        deadline = time.perf_counter() + 3 * min_time_s
                        while time.perf_counter() < deadline:
                            fn()
            dist.barrier()
            # sharing a node never speeds a rank up: a fraction above 1 is noise
            fractions.append(min(1.0, statistics.median(alone) / statistics.median(together)) if rank == 0 else 1.0)
        rows.append((float(k), fractions[0], fractions[1]))
    return rows


def _comm_worker(rank: int, world: int, backend: str, sizes: list[int],
                 message_bytes: list[int], min_time_s: float, batches: int, out: Any) -> None:
    """One calibration rank: the concurrency probe (CPU), then each op on the first ``n`` ranks
    for each ``n`` in ``sizes``; rank 0 reports ``{(op, n): [(payload bytes, seconds), ...]}``
    and ``("concurrency", 0): [(k, GEMM s, element-wise s), ...]``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = devices.pick_device("cuda" if backend == "nccl" else "cpu", rank, world)
    dist.init_process_group(backend, rank=rank, world_size=world)
    comm = Comm()
    result: dict[tuple[str, int], list[Any]] = {}
    try:
        if backend == "gloo":
            result[("concurrency", 0)] = _concurrency(rank, sizes, max(min_time_s, 0.05), max(batches, 7))
        for n in sizes:
            group = dist.new_group(list(range(n)))
            if rank >= n:
                dist.barrier()
                continue
            axis = Axis("dp", n, rank, tuple(range(n)), group, comm)
            for nbytes in message_bytes:
                numel = max(n, nbytes // 4 // n * n)
                full = torch.ones(numel, device=device)
                shard = torch.ones(numel // n, device=device)
                for op, fn in _axis_ops(comm, axis, full, shard).items():
                    dist.barrier(group=group)
                    t = _collective_time(fn, group, device, min_time_s, batches)
                    payload = shard.numel() * 4 if op == "all_gather" else numel * 4
                    t = t / 2 if op == "send" else t  # a ping-pong is two one-way messages
                    result.setdefault((op, n), []).append((float(payload), t))
            # the same calls between compute phases, as training issues them: what a rank
            # pays per call on top of the payload (wake-up after a wait, cold caches, skew)
            small = torch.ones(max(n, (1 << 16) // 4 // n * n), device=device)
            work = _busy_work(device)
            long_s, many = max(min_time_s, 0.1), max(batches, 5)  # differences of timings: average more
            for op, fn in _axis_ops(comm, axis, small, small[: small.numel() // n]).items():
                if op == "send":
                    continue
                dist.barrier(group=group)
                extra = statistics.median(  # interleaved pairs: load changes hit both sides alike
                    _collective_time(lambda fn=fn, work=work: (work(), fn()), group, device, long_s, many)
                    - _collective_time(work, group, device, long_s, many) for _ in range(PAIRS))
                payload = small.numel() * 4 // (n if op == "all_gather" else 1)
                result.setdefault((f"{op}@busy", n), []).append((float(payload), max(extra, 0.0)))
            if n == 2:
                hidden = statistics.median(_overlap(comm, axis, work, device, long_s, many) for _ in range(PAIRS))
                result[("overlap", n)] = [(hidden, 0.0)]
            comm.counter.reset()
            dist.barrier()
        if rank == 0:
            out.put(result)
    finally:
        dist.destroy_process_group()


PAIRS = 3  # repetitions of each difference-of-timings measurement; their median is kept


def _overlap(comm: Any, axis: Any, work: Callable[[], object], device: torch.device, min_time_s: float,
             batches: int) -> float:
    """The fraction of an async 1 MB all-reduce that ``work`` on the same rank hides (data
    parallelism's buckets reduce while backward computes): ``(work + comm - both) / min``."""
    t = torch.ones(1 << 18, device=device)

    def both() -> None:
        pending = comm.all_reduce_async(t, axis)
        work()
        pending.wait()

    t_work = _collective_time(work, axis.group, device, min_time_s, batches)
    t_comm = _collective_time(lambda: comm.all_reduce(t, axis), axis.group, device, min_time_s, batches)
    t_both = _collective_time(both, axis.group, device, min_time_s, batches)
    return min(1.0, max(0.0, (t_work + t_comm - t_both) / max(min(t_work, t_comm), 1e-9)))


def _busy_work(device: torch.device) -> Callable[[], object]:
    """A few milliseconds of GEMM work (one layer's share between two tensor-parallel calls)."""
    a = torch.randn(512, 512, device=device)
    return lambda: torch.mm(a, a)


def _axis_ops(comm: Any, axis: Any, full: torch.Tensor, shard: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The calls to time on ``axis``: each collective, and on a 2-rank axis a send/recv
    ping-pong (rank 0 sends first)."""
    ops: dict[str, Callable[[], object]] = {
        "all_reduce": lambda: comm.all_reduce(full, axis),
        "all_gather": lambda: comm.all_gather(shard, axis),
        "reduce_scatter": lambda: comm.reduce_scatter(full, axis),
    }
    if axis.size == 2:
        peer = axis.global_rank(1 - axis.rank)

        def ping() -> None:
            if axis.rank == 0:
                comm.send(full, peer, axis)
                comm.recv(full, peer, axis)
            else:
                comm.recv(full, peer, axis)
                comm.send(full, peer, axis)

        ops["send"] = ping
    return ops


def _collective_time(fn: Callable[[], object], group: Any, device: torch.device,
                     min_time_s: float, batches: int) -> float:
    """Median seconds per call over ``batches`` batches, every rank of ``group`` running the same
    number of calls per batch (the fewest any rank sized for ``min_time_s``, at most 1000)."""
    import torch.distributed as dist

    reps = torch.tensor([min(1000, reps_for(fn, device, min_time_s))], device=device)
    dist.all_reduce(reps, op=dist.ReduceOp.MIN, group=group)
    return median_per_call(fn, device, int(reps), batches, before_batch=lambda: dist.barrier(group=group))


def measure_comm(nproc: int, backend: str, plan: Plan,
                 progress: Callable[[str], None]) -> dict[tuple[str, int], list[tuple[float, float]]]:
    """Spawn ``nproc`` processes and time each collective for axis sizes 2, 4, ... and nproc."""
    sizes = sorted({2 ** i for i in range(1, int(math.log2(nproc)) + 1)} | {nproc})
    progress(f"  spawning {nproc} {backend} processes for axis sizes {sizes}")
    (result,) = run_ranks(_comm_worker, nproc, backend, sizes, list(plan.message_bytes), plan.min_time_s,
                          plan.batches, timeout=600,
                          error=lambda why: CalibrateError(f"calibration {why}; try a smaller --nproc"))
    return result


# ------------------------------------------------------------------------------- the profile


def _host_name(device: torch.device) -> str:
    if device.type != "cpu":
        return devices.device_name(device)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu {model}"


def calibrate(out: Path, nproc: int, quick: bool, device_name: str = "auto",
              progress: Callable[[str], None] = print) -> Path:
    """Measure, write the profile to ``out``, load it back (so a bad file never stays) and
    return its path."""
    if nproc < 1:
        raise CalibrateError(f"--nproc {nproc} must be >= 1 (1 skips the collectives)")
    device = devices.pick_device(device_name, 0, 1)  # a DeviceError if --device cuda finds none
    if device.type == "cuda" and nproc > devices.accelerator_count():
        progress(f"calibrate: only {devices.accelerator_count()} GPU(s): collectives measured up to that many")
        nproc = devices.accelerator_count()
    threads = 1 if device.type == "cpu" else torch.get_num_threads()
    torch.set_num_threads(threads)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    dtype_name = "fp32" if dtype == torch.float32 else "bf16"
    plan = Plan.for_device(device.type, quick)
    torch.manual_seed(0)
    t_start = time.perf_counter()
    progress(f"calibrate: {_host_name(device)}, {dtype_name} matmuls, {threads} thread(s) per process, "
             f"{'quick' if quick else 'full'} grids")
    rates = _compute_rates(plan, device, dtype, progress)
    backend = "nccl" if device.type == "cuda" else "gloo"
    comm_rows: list[dict[str, object]] = []
    concurrency: list[list[float]] = []
    cal_extra: dict[str, object] = {}
    if nproc >= 2:
        comm_rows, concurrency, cal_extra = _collective_fits(nproc, backend, plan, progress)
    else:
        progress("collectives: skipped (--nproc 1); the cost model keeps the link formula")
    gpu = _gpu_constants(device, rates, comm_rows)
    cal = {"device": device.type, "dtype": dtype_name, "backend": backend, "threads": threads,
           "source": f"hybridpar calibrate{' --quick' if quick else ''} --nproc {nproc}, torch {torch.__version__}",
           "block": list(rates.block_s), "concurrency": concurrency, **cal_extra, "gemm": rates.gemm,
           "attention": rates.attention}
    _write_profile(out, gpu, cal, comm_rows)
    progress(f"wrote {out} in {time.perf_counter() - t_start:.1f} s")
    return out


def _compute_rates(plan: Plan, device: torch.device, dtype: torch.dtype,
                   progress: Callable[[str], None]) -> ComputeRates:
    """The compute measurements (:func:`measure_compute`), reported as they come."""
    t0 = time.perf_counter()
    rates = measure_compute(plan, device, dtype)
    gemm, attention, bw, op_s, block = rates.gemm, rates.attention, rates.elementwise_bw, rates.small_op_s, rates.block_s
    progress(f"compute: {len(gemm)} GEMM shapes, {len(attention)} attention shapes and 4 eager probes in "
             f"{plan.batches} interleaved passes, {time.perf_counter() - t0:.1f} s")
    for m in plan.gemm_dims:
        progress(f"  gemm m={m}: best {max(r[3] for r in gemm if r[0] == m) / 1e9:,.1f} GFLOP/s")
    progress(f"attention: forward {min(r[2] for r in attention) / 1e9:,.1f}-"
             f"{max(r[2] for r in attention) / 1e9:,.1f} GFLOP/s")
    progress(f"memory: element-wise {bw / GB:,.1f} GB/s, one small op {op_s * 1e6:.1f} us")
    progress(f"eager block fixed cost: forward {block[0] * 1e6:.0f} us, backward {block[1] * 1e6:.0f} us")
    return rates


def _collective_fits(nproc: int, backend: str, plan: Plan, progress: Callable[[str], None]
                     ) -> tuple[list[dict[str, object]], list[list[float]], dict[str, object]]:
    """Measure the collectives on ``nproc`` processes: (one latency/bandwidth fit per op and
    size, the concurrency rows, the overlap fraction as ``{"overlap": f}`` when measured)."""
    t0 = time.perf_counter()
    measured = measure_comm(nproc, backend, plan, progress)
    comm_rows: list[dict[str, object]] = []
    concurrency: list[list[float]] = []
    cal_extra: dict[str, object] = {}
    probe = measured.pop(("concurrency", 0), [])
    if probe:
        concurrency = [list(row) for row in probe]
        progress("  busy ranks -> rate per rank: " + ", ".join(
            f"{int(k)}: GEMM x{fg:.2f}, element-wise x{fm:.2f}" for k, fg, fm in concurrency))
    overlap = measured.pop(("overlap", 2), [(None, 0.0)])[0][0]
    if overlap is not None:
        cal_extra["overlap"] = overlap
        progress(f"  async all-reduce hidden behind compute on the same rank: {100 * overlap:.0f}%")
    for (op, n), points in sorted(measured.items()):
        if op.endswith("@busy"):
            continue
        alpha, beta = fit_alpha_beta(points)
        if (f"{op}@busy", n) in measured:
            (payload, t_busy), = measured[(f"{op}@busy", n)]
            alpha = max(alpha, t_busy - beta * payload)  # the latency a computing rank sees
        comm_rows.append({"op": op, "size": n, "alpha": alpha, "beta": beta,
                          "points": [list(p) for p in points]})
        bus = (1 / beta if beta > 0 else float("inf")) / GB
        progress(f"  {op:<14} n={n}: latency {alpha * 1e6:8.1f} us, {bus:8.2f} GB/s of payload")
    progress(f"collectives: {len(comm_rows)} fits in {time.perf_counter() - t0:.1f} s")
    return comm_rows, concurrency, cal_extra


def _gpu_constants(device: torch.device, rates: ComputeRates, comm_rows: list[dict[str, object]]) -> dict[str, object]:
    """The profile's GPUSpec constants: the measured peak and bandwidths (the tables carry the
    shape detail); the link from the widest all-reduce's fit, else a default per device type."""
    allreduce = max((r for r in comm_rows if r["op"] == "all_reduce"), key=lambda r: r["size"], default=None)
    if allreduce is not None:
        n, alpha, beta = int(allreduce["size"]), float(allreduce["alpha"]), float(allreduce["beta"])  # type: ignore[call-overload]
        link_bw = 2 * (n - 1) / n / beta if beta > 0 else 1e12
        latency = alpha / (2 * (n - 1))
    else:
        link_bw, latency = (10 * GB, 50e-6) if device.type == "cpu" else (450 * GB, 5e-6)
    memory = float(devices.total_memory(device)) / (usable_cores() if device.type == "cpu" else 1)
    peak, bw = max(r[3] for r in rates.gemm), rates.elementwise_bw
    return {"name": f"calibrated {_host_name(device)}", "bf16_flops": peak, "fp32_flops": peak,
            "hbm_bytes": memory, "hbm_bw": bw, "intra_bw": link_bw, "inter_bw": link_bw,
            "intra_latency": latency, "inter_latency": latency, "gemm_efficiency": 1.0,
            "comm_efficiency": 1.0, "launch_overhead": rates.small_op_s,
            "host_bw": bw if device.type == "cpu" else 25 * GB}


def _write_profile(out: Path, gpu: dict[str, object], cal: dict[str, object], comm_rows: list[dict[str, object]]) -> None:
    """Write the profile TOML to ``out`` through a temporary file that must load back first."""
    header = (f"Hardware profile written by hybridpar calibrate on {time.strftime('%Y-%m-%d %H:%M:%S')}.\n"
              f"Rates in FLOP/s, bandwidths in bytes/s, times in s. gemm rows: [m, n, k, FLOP/s];\n"
              f"attention rows: [seq, head_dim, forward FLOP/s, backward FLOP/s]; comm: seconds = alpha + beta * "
              f"payload bytes.\nUse: hybridpar plan --gpu {out}; hybridpar train --parallel.auto true "
              f"--train.hardware {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(to_toml(gpu, cal, comm_rows, header))
    load_gpu_toml(tmp)  # never leave a profile the planner cannot read
    tmp.replace(out)

