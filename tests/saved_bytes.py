"""The saved-tensor meter: the runtime's peak activation bytes, as the planner models them.

Every tensor autograd saves for backward passes through a ``saved_tensors_hooks`` pack hook,
which counts its *storage* once (views and tensors saved by several nodes share one) and
releases it through a ``weakref.finalize`` on the packed handle when autograd frees it;
parameters (and views of them) are not activations and are skipped. The pipeline runner's own
records, ZB-H1's deferred linears and the storages activation offload brings back to the device
are counted the same way (tests/test_planner_validation.py says more; tensors offloaded to host
memory are not device bytes and pass the meter by). Shared by the planner-validation tests and the chunked-loss tests.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from hybridpar.config import load_config
from hybridpar.distributed.mesh import ParallelDims


class _Packed:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _is_parameter(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter)


class SavedBytesMeter:
    """Live bytes of the distinct storages held for backward, and their peak."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage pointer -> [holders, bytes]
        self.current = 0
        self.peak = 0

    def hold(self, t: torch.Tensor, owner: object) -> None:
        """Count ``t``'s storage until ``owner`` is garbage (once per storage)."""
        storage = t.untyped_storage()
        key = storage.data_ptr()
        entry = self.live.get(key)
        if entry is None:
            self.live[key] = [1, storage.nbytes()]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        weakref.finalize(owner, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]

    def pack(self, t: torch.Tensor) -> object:
        if _is_parameter(t):
            return t
        packed = _Packed(t.detach())  # no grad_fn: a saved output must not keep its own node alive
        self.hold(t, packed)
        return packed

    @staticmethod
    def unpack(x: object) -> torch.Tensor:
        return x.tensor if isinstance(x, _Packed) else x  # type: ignore[return-value]


# The tiny preset (dim 128, 8 layers, 8 heads, 4 kv heads, ffn 384, vocab 256); 64 tokens,
# micro-batch 2, global batch 8.
def _metered(saved_cls: type, meter: SavedBytesMeter) -> type:
    """A record class of the pipeline runtime (the runner's per-(micro-batch, chunk) record, or
    ZB-H1's deferred linear), its tensors counted by ``meter`` while the record lives."""

    class Metered(saved_cls):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: object) -> None:
            object.__setattr__(self, key, value)
            if isinstance(value, torch.Tensor):
                meter.hold(value, self)

    return Metered


def _metered_recompute(meter: SavedBytesMeter):
    """The runtime's recompute wrapper with the recomputation counted. When backward reruns a
    block (or attention core), the same forward first runs once more on detached aliases of its
    inputs under a probe meter: the storages it saves that are not already live are what the
    recomputation holds until that block's backward ends (torch checks that the recomputation
    saves the same tensors as the original forward), added to the live bytes of that moment."""
    from torch.utils.checkpoint import checkpoint

    def recomputed(fn, *args):
        calls = [0]

        def run(*a):
            calls[0] += 1
            if calls[0] > 1:  # backward's recomputation
                probe = SavedBytesMeter()
                alias = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in a]
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(probe.pack, probe.unpack):
                    out = fn(*alias)
                extra = sum(nbytes for key, (_, nbytes) in probe.live.items() if key not in meter.live)
                meter.peak = max(meter.peak, meter.current + extra)
                del out
            return fn(*a)

        return checkpoint(run, *args, use_reentrant=False)

    return recomputed


def measure_activations(rank: int, world: int, layouts: dict[str, list[str]]) -> dict[str, tuple[int, int]]:
    """Per layout (name -> trainer config arguments): (this rank's pipeline rank, its peak saved
    bytes over one forward_backward)."""
    from hybridpar.parallel import offload_activations, recompute
    from hybridpar.parallel.context import zigzag_shard
    from hybridpar.parallel.pipeline import runtime, wsplit
    from hybridpar.training.engine import Engine

    out = {}
    original, original_recompute, original_linear = runtime._Saved, recompute._recomputed, wsplit._Linear
    original_hooks = wsplit._pack, wsplit._unpack
    original_resident = offload_activations._Resident
    original_kept = offload_activations._keep, offload_activations._kept
    for name, argv in layouts.items():
        cfg = load_config(None, argv)
        meter = SavedBytesMeter()
        runtime._Saved = _metered(original, meter)
        wsplit._Linear = _metered(original_linear, meter)
        wsplit._pack, wsplit._unpack = meter.pack, meter.unpack  # what deferred linears' nodes save
        recompute._recomputed = _metered_recompute(meter)
        offload_activations._Resident = _metered(original_resident, meter)  # brought back before backward
        offload_activations._keep, offload_activations._kept = meter.pack, meter.unpack  # left on the device
        try:
            with ParallelDims.from_config(cfg.parallel).build("cpu") as topo:
                engine = Engine(cfg, topo, torch.device("cpu"))
                t, gen = cfg.train, torch.Generator().manual_seed(topo.dp.rank)
                batches = []
                for _ in range(t.global_batch // (cfg.parallel.dp * t.micro_batch)):
                    x = torch.randint(0, cfg.model.vocab_size, (t.micro_batch, t.seq_len + 1), generator=gen)
                    xs, ys = x[:, :-1].contiguous(), x[:, 1:].contiguous()
                    if topo.cp.size > 1:
                        xs, ys = zigzag_shard(xs, topo.cp), zigzag_shard(ys, topo.cp)
                    batches.append((xs, ys))
                with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                    engine.forward_backward(batches, 1.0 / len(batches))
                out[name] = (topo.pp.rank, meter.peak)
        finally:
            runtime._Saved, recompute._recomputed, wsplit._Linear = original, original_recompute, original_linear
            wsplit._pack, wsplit._unpack = original_hooks
            offload_activations._Resident = original_resident
            offload_activations._keep, offload_activations._kept = original_kept
    return out
