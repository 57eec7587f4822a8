"""INT8 gradient compression's block arithmetic (:mod:`hybridpar.distributed.compression`):
block size, padding and bytes on the wire. No torch, so the planner prices compression without
importing it.
"""

from __future__ import annotations

BLOCK = 256  # elements per fp32 scale: 1 + 4/256 bytes per element on the wire
QMAX = 127  # symmetric int8 range [-127, 127] (-128 unused: q and -q are both representable)


def padded(numel: int) -> int:
    """``numel`` rounded up to whole blocks."""
    return -(-numel // BLOCK) * BLOCK


def wire_numel(numel: int) -> int:
    """Bytes of ``numel`` elements (a multiple of :data:`BLOCK`) on the wire: int8 values and
    one fp32 scale per block."""
    return numel + 4 * (numel // BLOCK)
