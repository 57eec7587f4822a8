"""Pipeline parallelism: schedules as data, a simulator, a runtime, partitioning, timelines.

One source of truth: :func:`build_schedule` makes the per-rank action lists that
:class:`PipelineRunner` executes, :func:`simulate` times, :func:`plot_timeline` draws and the
tests check. Torch-free pieces (schedules, simulate, partition) import no process group.
"""

from hybridpar.parallel.pipeline.partition import (
    Balance,
    ChunkSpec,
    Partition,
    partition_layers,
    partition_model,
)
from hybridpar.parallel.pipeline.schedules import (
    Action,
    ActionKind,
    PipelineSchedule,
    Schedule,
    ScheduleError,
    build_schedule,
    check_schedule_args,
    max_in_flight,
    promised_in_flight,
    schedule_warnings,
)
from hybridpar.parallel.pipeline.simulate import (
    Costs,
    DeadlockError,
    Interval,
    Timeline,
    check_schedule,
    simulate,
    textbook_bubble,
)

__all__ = [
    "Action",
    "ActionKind",
    "Balance",
    "ChunkSpec",
    "Costs",
    "DeadlockError",
    "Interval",
    "Partition",
    "PipelineSchedule",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "build_schedule",
    "check_schedule",
    "check_schedule_args",
    "max_in_flight",
    "partition_layers",
    "partition_model",
    "promised_in_flight",
    "schedule_warnings",
    "simulate",
    "textbook_bubble",
]
