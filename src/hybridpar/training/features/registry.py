"""The registry: every component, in the one order their build steps and hooks run.

Adding a feature is a file in this package with its :class:`Component` and one line in
:data:`COMPONENTS` (``docs/architecture-components.md``). The order is declared here once and
checked at import (:func:`check_order`): a component's :attr:`Component.after` names those that
must come before it, and a name that is unknown, repeated or out of order is an ``ImportError``,
never a silent change of behaviour.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridpar.config import Config
from hybridpar.training.features.activation_offload import ActivationOffloadComponent
from hybridpar.training.features.async_checkpoint import AsyncCheckpoint
from hybridpar.training.features.compile import CompileComponent
from hybridpar.training.features.component import Component, Components, Launch
from hybridpar.training.features.elastic import ElasticComponent
from hybridpar.training.features.fp8 import Fp8Component
from hybridpar.training.features.int8 import Int8Compression
from hybridpar.training.features.moe import MixtureOfExperts
from hybridpar.training.features.snapshot import Snapshots
from hybridpar.training.features.twobw import TwoBWComponent

__all__ = ["COMPONENTS", "check_order", "components_for"]

#: every component in build and hook order (checked by :func:`check_order` below)
COMPONENTS: tuple[type[Component], ...] = (
    MixtureOfExperts,
    TwoBWComponent,
    Int8Compression,
    AsyncCheckpoint,
    Snapshots,
    ActivationOffloadComponent,
    Fp8Component,
    CompileComponent,
    ElasticComponent,
)


def check_order(components: Sequence[type[Component]]) -> None:
    """Raise ``ImportError`` unless every component has a unique name and every name in its
    ``after`` is registered, earlier."""
    seen: dict[str, int] = {}
    for i, kind in enumerate(components):
        if kind.name in seen:
            raise ImportError(f"component name {kind.name!r} is registered twice ({kind.__name__})")
        seen[kind.name] = i
    for kind in components:
        for before in kind.after:
            if before not in seen:
                raise ImportError(f"{kind.__name__}.after names {before!r}, which is no registered component")
            if seen[before] > seen[kind.name]:
                raise ImportError(f"{kind.__name__} ({kind.name!r}) must be registered after {before!r} "
                                  f"(its 'after'), not before it")


check_order(COMPONENTS)


def components_for(cfg: Config, launch: Launch | None = None) -> Components:
    """The components a run under ``cfg`` has, decided once, in registry order."""
    launch = launch or Launch()
    return Components([kind(cfg, launch) for kind in COMPONENTS if kind.enabled(cfg, launch)])
