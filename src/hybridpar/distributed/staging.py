"""Host staging of CUDA tensors for gloo collectives: the one-GPU test mode.

NCCL refuses two ranks on one device, so the test mode that runs a multi-rank layout with CUDA
tensors on one GPU (:func:`~hybridpar.distributed.device.shared_gpu`, ``HYBRIDPAR_SHARED_GPU=1``)
runs its process groups on gloo. gloo takes CUDA tensors for only some collectives, so
:class:`~hybridpar.distributed.comm.Comm` hands every collective a :class:`Host` view of its
tensors: a host copy on a gloo group, the tensor itself anywhere else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def is_gloo(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` runs on gloo (CPU collectives)."""
    return dist.get_backend(group) == "gloo"


class Host:
    """``t`` as a gloo collective can take it. gloo's CUDA support covers only some collectives,
    so on a gloo group a CUDA tensor (the one-GPU test mode,
    :func:`~hybridpar.distributed.device.shared_gpu`) is staged: ``host`` is a host copy (or, with
    ``read=False``, an uninitialised host buffer for an output) and :meth:`back` copies it into
    ``t``. Anywhere else ``host`` is ``t`` itself and :meth:`back` does nothing."""

    __slots__ = ("host", "staged", "t")

    def __init__(self, t: torch.Tensor, group: dist.ProcessGroup | None, read: bool = True) -> None:
        self.t = t
        self.staged = t.device.type != "cpu" and is_gloo(group)
        if not self.staged:
            self.host = t
        else:
            self.host = t.cpu() if read else torch.empty(t.shape, dtype=t.dtype)

    def back(self) -> torch.Tensor:
        """Copy the host buffer into the device tensor (staged only); returns the device tensor."""
        if self.staged:
            self.t.copy_(self.host)
        return self.t

    def then(self) -> list[Callable[[], object]]:
        """:meth:`back` as a :class:`Pending` continuation (none when nothing is staged)."""
        return [self.back] if self.staged else []
