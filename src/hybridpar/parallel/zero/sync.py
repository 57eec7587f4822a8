"""The switch every data-parallel gradient path shares: whether backward hooks communicate."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["GradientSync"]


class GradientSync:
    """``sync``: backward hooks start their reductions (True) or leave gradients to accumulate
    locally (inside :meth:`no_sync`, e.g. the earlier micro-batches of a step)."""

    sync: bool = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: no communication inside this block."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous
