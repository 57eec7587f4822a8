"""How many of a chunk's blocks activation offload takes (``parallel.offload_activations_fraction``):
the rule :mod:`hybridpar.parallel.offload_activations` applies and the planner prices. No torch,
so ``hybridpar plan`` need not import it.
"""

from __future__ import annotations

import math


def offloaded_count(layers: int, fraction: float) -> int:
    """How many of a chunk's ``layers`` blocks are offloaded at ``fraction`` (the first ones):
    ``ceil(fraction * layers)``, so any positive fraction offloads at least one."""
    return min(layers, math.ceil(fraction * layers - 1e-9)) if fraction > 0 else 0
