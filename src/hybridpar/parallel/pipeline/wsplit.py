"""Split backward for zero-bubble schedules: B computes input gradients, W weight gradients.

The zero-bubble paper's per-linear split (Qi et al. 2023, section 2), applied to any chunk from
outside. While a chunk's forward runs under :class:`WeightGradSplit` (a ``TorchFunctionMode``),
every ``F.linear(x, W, b)`` whose weight belongs only to linear layers of the chunk is built as
two graphs:

* an *inner* graph ``y = F.linear(x', W, b)`` on ``x' = x.detach()`` made to require grad: the
  very nodes a plain ``F.linear`` would record, saving ``x'`` (the same storage as ``x``) and ``W``;
* an *outer* node (:class:`_Bridge`) that links ``x`` to ``y`` in the chunk's graph. Its backward
  (run by B) computes the input gradient through the inner graph, ``autograd.grad(y, x', gy)``,
  and keeps the output gradient ``gy``.

B is then an ordinary full backward of the chunk's graph: the input gradient goes upstream, the
weights of everything else (norms, embeddings, a tied head) get their gradients at once, and
the chunk's graph is freed. What stays until W is exactly what the deferred weight gradients
need: per deferred linear, its input ``x'`` (saved in the inner node) and its output gradient
``gy``. W (:meth:`Deferred.weight_grads`) runs one ``torch.autograd.backward`` over all of a
micro-batch's inner graphs with ``inputs`` = their parameters: only the weight-gradient half of
each linear's backward runs (no re-traversal of the chunk), it accumulates into ``.grad`` and
fires each parameter's post-accumulate-grad hooks once (the gradient reducer and ZeRO count on
them), as a plain backward would.

Why W-split gradients equal plain backward's bit for bit: the inner graph is recorded by the same
``aten::linear`` call on the same values (same shapes, strides, dtypes, autocast state) as the
plain graph's, so its nodes run the same kernels; the output gradient ``gy`` reaching a linear is
the same tensor, because everything above it in the chunk's graph is unchanged and the input
gradient each deferred linear returns comes from the same node's same formula; and each
parameter receives the same per-micro-batch gradient into ``.grad`` in the same micro-batch order.
(A parameter used by several deferred linears of one chunk is summed by the engine in W in its
own order; the models here use each weight once per chunk.)

Recomputation (``torch.utils.checkpoint``): the inner graph saves its tensors outside the
checkpoint's hooks (they are what W needs after the block's recomputed graph is gone), and B
runs under the mode too, so a recomputed forward records the same saved tensors as the first.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, saved_tensors_hooks
from torch.overrides import TorchFunctionMode

from hybridpar.compat import saved_tensor_hooks_active
from hybridpar.parallel.fp8 import fp8_linear
from hybridpar.parallel.tensor import ColumnParallelLinear, RowParallelLinear

LINEAR_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, ColumnParallelLinear, RowParallelLinear)


def deferrable_params(chunk: nn.Module) -> set[nn.Parameter]:
    """The parameters whose gradient W may compute: those owned only by linear layers (a weight
    shared with an embedding, like a tied head, gets its gradient in B with the embedding's)."""
    owners: dict[nn.Parameter, list[nn.Module]] = {}
    for module in chunk.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(p, []).append(module)
    return {p for p, mods in owners.items()
            if p.requires_grad and all(isinstance(m, LINEAR_TYPES) for m in mods)}


@dataclass
class _Linear:
    """One deferred linear: its inner graph's output edge and input edge, its parameters, the
    storages its inner nodes saved and (after B) its output gradient."""

    edge: GradientEdge
    # where x' enters the inner graph (B asks for its gradient): x' itself when the linear saves it
    # anyway (a plain leaf), else the gradient edge, which does not keep x' alive until B (under
    # autocast the linear saves only its half copy)
    source: Tensor | GradientEdge | None
    params: tuple[Tensor, ...]
    saved: list[torch.UntypedStorage]  # what the inner nodes save, parameters left out
    grad: Tensor | None = None


@dataclass
class Deferred:
    """The deferred linears of one (micro-batch, chunk): filled by F, given gradients by B,
    consumed by :meth:`weight_grads` (W)."""

    linears: list[_Linear] = field(default_factory=list)

    def held_bytes(self) -> int:
        """Bytes kept from B to W beyond the parameters: each distinct storage among what the
        linears' weight-gradient nodes saved (inputs; under autocast their and the weights'
        half copies) and the output gradients."""
        seen: dict[int, int] = {}
        for lin in self.linears:
            grad = [] if lin.grad is None else [lin.grad.untyped_storage()]
            for s in lin.saved + grad:
                seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())

    def weight_grads(self) -> None:
        """W: the weight gradients of every linear that received an output gradient, accumulated
        into ``.grad`` by one engine run (post-accumulate-grad hooks fire once per parameter)."""
        done = [lin for lin in self.linears if lin.grad is not None]
        self.linears = []
        if not done:
            return
        params = list({id(p): p for lin in done for p in lin.params}.values())
        torch.autograd.backward([lin.edge for lin in done], [lin.grad for lin in done], inputs=params)


class _Bridge(torch.autograd.Function):
    """The outer graph's node for a deferred linear: forward passes the inner output through,
    backward returns the input gradient and keeps the output gradient for W."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out: Tensor, lin: _Linear) -> Tensor:
        ctx.lin = lin
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        lin: _Linear = ctx.lin
        lin.grad = grad
        (gx,) = torch.autograd.grad(lin.edge, lin.source, grad, retain_graph=True)
        lin.source = None
        return gx, None, None


class _Source(torch.autograd.Function):
    """The start of an inner graph whose linear saves something else than ``x'`` (an autocast
    half copy, a contiguous copy): ``x'`` as a differentiable tensor whose graph holds no reference
    to it, where a leaf's grad accumulator would keep ``x`` alive until W as well. ``anchor`` only
    makes the output require grad; no gradient ever reaches it. (Where the linear saves ``x'``
    itself, :meth:`WeightGradSplit.defer` starts from a plain leaf, one custom Function call
    cheaper.)"""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, x: Tensor) -> Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None]:
        return None, None


_ANCHOR = torch.zeros((), requires_grad=True)


def _pack(t: Tensor) -> Any:
    """Saved-tensor hooks of the inner graphs: keep the tensor itself, whatever hooks are around
    (tests swap these two for counting ones)."""
    return t


def _unpack(t: Any) -> Tensor:
    return t


def _linear_args(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    return input, weight, bias


#: The split runs outside compiled graphs (``train.compile``): a compiled block graph-breaks at each
#: linear layer's hooks and at its ``F.linear``, so the deferred linears are built eagerly as
#: above and only the code between them (norms, attention, activations) is compiled.
_eager = torch.compiler.disable(recursive=True)


class _DeferLinear(TorchFunctionMode):
    """Turns ``F.linear`` on a deferrable weight into a deferred linear (active only inside the
    forward of a linear layer, by :class:`WeightGradSplit`'s module hooks)."""

    def __init__(self, split: WeightGradSplit) -> None:
        super().__init__()
        self.split = split

    @_eager
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (func is F.linear or func is fp8_linear) and torch.is_grad_enabled():
            x, weight, bias = _linear_args(*args[:3], **kwargs)
            deferrable = self.split.deferrable
            if weight in deferrable and x.requires_grad and (bias is None or bias in deferrable):
                linear = F.linear if func is F.linear else functools.partial(fp8_linear, layout=args[3])
                return self.split.defer(x, weight, bias, linear)
        return func(*args, **kwargs)


class WeightGradSplit:
    """Defers the weight gradients of ``chunks``' linear layers (see the module docstring).

    Forward pre/post hooks on every linear layer switch a ``TorchFunctionMode`` on for the
    layer's forward, but only while :meth:`forward` or :meth:`backward` is active, so the modules
    (shared with the model) behave as usual elsewhere. Hooks rather than one mode around the
    chunk because the autograd engine does not carry modes into backward, where recomputation
    (``torch.utils.checkpoint``) runs a block's forward again and must record the same graph.
    """

    def __init__(self, chunks: list[nn.Module]) -> None:
        self.deferrable: set[nn.Parameter] = set()
        for chunk in chunks:
            self.deferrable |= deferrable_params(chunk)
        self.active = False
        self.record: Deferred | None = None
        self._mode = _DeferLinear(self)
        self._depth = 0
        self._handles = []
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, LINEAR_TYPES):
                    self._handles.append(module.register_forward_pre_hook(self._enter))
                    self._handles.append(module.register_forward_hook(self._exit, always_call=True))

    @_eager
    def _enter(self, module: nn.Module, args: Any) -> None:
        if self.active:
            if self._depth == 0:
                self._mode.__enter__()
            self._depth += 1

    @_eager
    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.active and self._depth:
            self._depth -= 1
            if self._depth == 0:
                self._mode.__exit__(None, None, None)

    @contextlib.contextmanager
    def _active(self, record: Deferred | None) -> Iterator[None]:
        previous = self.active, self.record
        self.active, self.record = True, record
        try:
            yield
        finally:
            self.active, self.record = previous

    def forward(self, into: Deferred) -> contextlib.AbstractContextManager[None]:
        """Run a chunk's forward inside this: its deferred linears are recorded ``into``."""
        return self._active(into)

    def backward(self) -> contextlib.AbstractContextManager[None]:
        """Run B inside this (recomputed forwards defer alike; they are not recorded)."""
        return self._active(None)

    def defer(self, x: Tensor, weight: Tensor, bias: Tensor | None, linear: Any = F.linear) -> Tensor:
        """``F.linear(x, weight, bias)`` as a deferred linear (module docstring). Runs once per
        linear layer per micro-batch, so it keeps to few Python and autograd calls: between GEMMs
        each costs several times what it does in a tight loop (on the compute benchmark's stages,
        4 linear layers, a deferred forward took ~0.5 ms more than the plain ~24 ms one with pack
        hooks, ~0.35 ms without, against ~0.2 ms at toy sizes; the hooks and mode alone ~0.1 ms).

        ``x'`` is a plain leaf when the linear saves it as it is (contiguous, no autocast): then it
        holds nothing the linear does not, and what W keeps is ``x'``'s storage. Otherwise (a cast
        or a contiguous copy is saved) it comes from :class:`_Source`, and pack hooks record the
        storages saved; they also run whenever other saved-tensor hooks are active (a checkpoint's,
        which would drop the tensors W needs), so that the inner graph saves for real.

        ``linear``: the layer's GEMM, ``F.linear`` or (``fp8.recipe``) an FP8 one, whose backward
        runs only the GEMM its caller asks for (B: the input's; W: the weight's)."""
        params = (weight,) if bias is None else (weight, bias)
        own = {p.untyped_storage().data_ptr() for p in params}
        leaf = linear is F.linear and x.is_contiguous() and not torch.is_autocast_enabled(x.device.type)
        inp = x.detach().requires_grad_() if leaf else _Source.apply(_ANCHOR, x.detach())
        if leaf and not saved_tensor_hooks_active():
            out = F.linear(inp, weight, bias)  # saves x' (or a view of it) and the weight
            storage = inp.untyped_storage()
            saved = [] if storage.data_ptr() in own else [storage]
        else:
            saved = []

            def pack(t: Tensor) -> Any:
                if t.untyped_storage().data_ptr() not in own:
                    saved.append(t.untyped_storage())
                return _pack(t)

            with saved_tensors_hooks(pack, _unpack):  # saved for real, also inside a checkpoint
                out = linear(inp, weight, bias)
        source = inp if leaf else GradientEdge(inp.grad_fn, inp.output_nr)
        lin = _Linear(GradientEdge(out.grad_fn, out.output_nr), source, params, saved)
        if self.record is not None:
            self.record.linears.append(lin)
        return _Bridge.apply(x, out.detach(), lin)

    def remove(self) -> None:
        """Take the hooks off the modules."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
