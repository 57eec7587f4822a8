"""Features as components, one file each: a :class:`Component` owns one feature's enabled-ness,
build steps, step hooks and state (:mod:`.component`); :mod:`.registry` lists them in the one
checked order and :func:`components_for` picks a run's from its config, once. Adding one: a file
here with its class, and a line in :data:`~.registry.COMPONENTS`
(``docs/architecture-components.md``).
"""

from __future__ import annotations

from hybridpar.training.features.base import StepFeature, StepHooks, UpdateOutcome
from hybridpar.training.features.component import Component, Components, Launch, RunContext
from hybridpar.training.features.registry import COMPONENTS, components_for

__all__ = ["COMPONENTS", "Component", "Components", "Launch", "RunContext", "StepFeature", "StepHooks", "UpdateOutcome",
           "components_for"]
