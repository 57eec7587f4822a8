"""Data parallelism and ZeRO: the optimizers behind :class:`DataParallelOptimizer`.

One folder for the data-parallel axis (as picotron keeps one per parallelism). The step engine
types against :class:`~hybridpar.parallel.zero.base.DataParallelOptimizer`; its implementations
are :class:`ZeroOptimizer` (stages 0-3), :class:`ExpertSplitOptimizer` (dense and expert
parameters over their own axes) and :class:`~hybridpar.parallel.zero.base.LocalOptimizer` (a
plain torch optimizer without data parallelism).

==================  ===============================================================
module              what it holds
==================  ===============================================================
``base``            the interface, the plain-optimizer implementation, clipping
``optimizer``       :class:`ZeroOptimizer`: validation, inner optimizer, checkpoints
``options``         parameter groups, compression names, option checks
``stage``           what a stage family answers (``ZeroStage``), slots, groups
``stages``          stage 0 (``Replicated``), 1/2 (``ShardedState``), 3 (``ShardedParams``)
``reducer``         stage 0's bucketed gradient all-reduce (:class:`GradientReducer`)
``shard``           the dim-0 shard layout and the gradient reduce-scatter
``replicate``       hybrid sharding (HSDP): the shard's sum across replica groups
``unit``            a ZeRO-3 unit and its gather state
``zero3``           ZeRO-3 parameter sharding (:func:`shard_model`)
``zero3_pp``        ZeRO-3 under pipeline parallelism (:func:`shard_stages`)
``expert_split``    :class:`ExpertSplitOptimizer` (expert parallelism)
``offload``         ZeRO-Infinity: state in memory-mapped files
==================  ===============================================================
"""

from hybridpar.parallel.zero.base import DataParallelOptimizer, ErrorFeedback, LocalOptimizer
from hybridpar.parallel.zero.expert_split import ExpertlessStage, ExpertSplitOptimizer
from hybridpar.parallel.zero.optimizer import ZeroOptimizer
from hybridpar.parallel.zero.options import COMPRESSION_DTYPES, decay_groups
from hybridpar.parallel.zero.reducer import GradientReducer
from hybridpar.parallel.zero.replicate import Replicas
from hybridpar.parallel.zero.shard import OuterSplit
from hybridpar.parallel.zero.zero3 import ShardedModel, shard_model
from hybridpar.parallel.zero.zero3_pp import StageSharded, shard_stages

__all__ = ["COMPRESSION_DTYPES", "DataParallelOptimizer", "ErrorFeedback", "ExpertSplitOptimizer", "ExpertlessStage", "GradientReducer",
           "LocalOptimizer", "OuterSplit", "Replicas", "ShardedModel", "StageSharded", "ZeroOptimizer", "decay_groups", "shard_model",
           "shard_stages"]
