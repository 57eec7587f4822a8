"""Every shape and layout rule of a run, stated once, as values.

A :class:`Rule` has a ``name`` (what the planner reports when it rejects a layout, and how it
asks for one) and a check that returns ``None`` when the config keeps the rule, or the one-line
message (numbers and fix) when it breaks it. :func:`hybridpar.config.validate` raises the first
broken rule's message; the planner (:mod:`hybridpar.planner.model.layout`) asks :func:`first_broken`
for the rule itself (a :class:`Broken`) instead of reading messages; model families check their
tensor-parallel split with :func:`tp_split_error` (the ``tp-*`` rules) and the pipeline its
partition and schedule with :func:`partition_error` and :func:`schedule_error`, so nothing
restates a rule elsewhere.

Rules run in order: a rule may assume the ones before it hold (positive sizes first). The order
is :mod:`~hybridpar.rules.model` (the model's shape, then the settings), then
:mod:`~hybridpar.rules.layout`.
"""

from hybridpar.rules.base import RULES, Broken, PipelineShape, Rule, first_broken
from hybridpar.rules.model import MOE_FAMILIES, OPTIMIZER_IMPLS, model_error, optimizer_impl_error

# isort: split
# the layout rules register after the model's: rule order
from hybridpar.rules.layout import partition_error, schedule_error, tp_split_error, ulysses_error

# isort: split
from hybridpar.rules.fp8 import FP8_MODES, fp8_device_error, fp8_gathers

# isort: split
from hybridpar.rules import deepseek  # noqa: F401  (registers DeepSeek-V3's rules)

__all__ = ["FP8_MODES", "MOE_FAMILIES", "OPTIMIZER_IMPLS", "RULES", "Broken", "PipelineShape", "Rule", "first_broken",
           "fp8_device_error", "fp8_gathers", "model_error", "optimizer_impl_error", "partition_error", "schedule_error", "tp_split_error",
           "ulysses_error"]
