"""DeepSpeed's front door: ``import hybridpar as deepspeed`` and a DeepSpeed training loop runs on
hybridpar's engine. ``hybridpar.initialize`` routes here when called DeepSpeed's way
(``config_params=``, ``model_parameters=``, a ds_config path or dict, ...); docs/howto/deepspeed.md
lists every key and what it maps to.

* :mod:`.schema`: the keys read, accepted without effect, and refused;
* :mod:`.config`: a ds_config onto :class:`~hybridpar.api.engine.EngineConfig`;
* :mod:`.schedules`: DeepSpeed's LR schedules; :mod:`.checkpoint`: ``save_checkpoint``/``load_checkpoint``;
* :mod:`.engine`: :class:`DeepSpeedEngine`; :mod:`.pipe`: ``train_batch`` for a PipelineModule;
* :mod:`.front`: ``initialize``'s DeepSpeed arguments.
"""

from hybridpar.api.deepspeed.config import DeepSpeedConfig, parse_ds_config
from hybridpar.api.deepspeed.engine import DeepSpeedEngine
from hybridpar.api.deepspeed.front import deepspeed_initialize

__all__ = ["DeepSpeedConfig", "DeepSpeedEngine", "deepspeed_initialize", "parse_ds_config"]
