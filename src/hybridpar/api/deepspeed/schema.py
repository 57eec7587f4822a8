"""The DeepSpeed configuration keys this front door reads, block by block, and the ones it refuses.

Every key a ``ds_config`` may hold is in one of three places here: a block's ``supported`` keys
(read by :mod:`hybridpar.api.deepspeed.config` onto :class:`~hybridpar.api.engine.EngineConfig`),
``NO_EFFECT`` (performance knobs of DeepSpeed's own implementation whose every value gives the
same result here; accepted, and named once on rank 0 at start-up), or ``DEFAULT_ONLY`` (accepted
at DeepSpeed's default value, refused at any other). Anything else is refused in one line that
names the key, says whether it is DeepSpeed's but not implemented (``KNOWN_UNSUPPORTED``) or
unknown (with a did-you-mean from :func:`difflib.get_close_matches`), and lists what the block
supports. docs/howto/deepspeed.md is the same table for people.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from hybridpar.config import ConfigError

__all__ = ["BLOCKS", "DEFAULT_ONLY", "KNOWN_UNSUPPORTED", "NO_EFFECT", "RENAMED", "SWITCHED_OFF", "check_keys"]

# block path ("" = top level) -> keys read
BLOCKS: dict[str, tuple[str, ...]] = {
    "": ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
         "scheduler", "fp16", "bf16", "gradient_clipping", "zero_optimization", "activation_checkpointing",
         "tensor_parallel", "bfloat16", "steps_per_print", "tensorboard", "communication_data_type",
         "zero_allow_untested_optimizer", "wall_clock_breakdown", "prescale_gradients", "gradient_predivide_factor",
         "memory_breakdown", "dump_state", "sparse_gradients", "zero_force_ds_cpu_optimizer", "data_types",
         "checkpoint"),
    "optimizer": ("type", "params"),
    "optimizer.params.adam": ("lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode", "amsgrad"),
    "optimizer.params.sgd": ("lr", "momentum", "weight_decay", "nesterov", "dampening"),
    "scheduler": ("type", "params"),
    "scheduler.params.warmuplr": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "scheduler.params.warmupdecaylr": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                                       "total_num_steps"),
    "scheduler.params.warmupcosinelr": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
                                        "warmup_type"),
    "fp16": ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale", "auto_cast", "fp16_master_weights_and_grads"),
    "bf16": ("enabled",),
    "zero_optimization": ("stage", "reduce_bucket_size", "offload_optimizer", "offload_param",
                          "stage3_prefetch_bucket_size", "zero_hpz_partition_size", "allgather_partitions",
                          "allgather_bucket_size", "overlap_comm", "reduce_scatter", "contiguous_gradients",
                          "round_robin_gradients", "sub_group_size", "stage3_param_persistence_threshold",
                          "stage3_max_live_parameters", "stage3_max_reuse_distance",
                          "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                          "ignore_unused_parameters", "cpu_offload", "cpu_offload_params"),
    "zero_optimization.offload_optimizer": ("device", "nvme_path", "pin_memory", "buffer_count", "fast_init",
                                            "ratio"),
    "zero_optimization.offload_param": ("device", "nvme_path", "pin_memory", "buffer_count", "buffer_size",
                                        "max_in_cpu"),
    "activation_checkpointing": ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                                 "number_checkpoints", "synchronize_checkpoint_boundary", "profile"),
    "tensor_parallel": ("autotp_size",),
    "tensorboard": ("enabled", "output_path", "job_name"),
    "data_types": ("grad_accum_dtype",),
    "checkpoint": ("tag_validation", "load_universal", "use_node_local_storage", "parallel_write"),
    "checkpoint.parallel_write": ("pipeline_stage",),
}

# DeepSpeed's blocks with an "enabled" switch for features this front door does not have:
# accepted when switched off (what they would do does not happen), refused when switched on
SWITCHED_OFF = ("flops_profiler", "wandb", "csv_monitor", "comet", "comms_logger", "amp", "elasticity")

# accepted with any value: DeepSpeed's implementation knobs; here the result is the same whatever they say
NO_EFFECT: dict[str, str] = {
    "zero_allow_untested_optimizer": "Adam, AdamW and SGD are the optimizers read",
    "zero_optimization.allgather_partitions": "stages 1-2 all-gather the updated parameters in the reduce buckets",
    "zero_optimization.allgather_bucket_size": "stages 1-2 all-gather in the reduce buckets (reduce_bucket_size)",
    "zero_optimization.overlap_comm": "the gradient reduction always overlaps backward",
    "zero_optimization.reduce_scatter": "stages 1-2 always reduce-scatter",
    "zero_optimization.contiguous_gradients": "buckets are contiguous",
    "zero_optimization.round_robin_gradients": "shards are rows of every parameter",
    "zero_optimization.sub_group_size": "the optimizer steps each rank's shard at once",
    "zero_optimization.stage3_param_persistence_threshold": "every parameter is sharded",
    "zero_optimization.stage3_max_live_parameters": "one unit is gathered at a time (plus one prefetched)",
    "zero_optimization.stage3_max_reuse_distance": "a unit is gathered per use",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "checkpoints always hold the whole weights",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "checkpoints always hold the whole weights",
    "zero_optimization.ignore_unused_parameters": "unused parameters get zero gradients",
    "zero_optimization.offload_optimizer.pin_memory": "host copies are pinned on GPU machines",
    "zero_optimization.offload_optimizer.buffer_count": "the disk store sizes its own buffers",
    "zero_optimization.offload_optimizer.fast_init": "offloaded state is created at start",
    "zero_optimization.offload_param.pin_memory": "host copies are pinned on GPU machines",
    "zero_optimization.offload_param.buffer_count": "the disk store sizes its own buffers",
    "zero_optimization.offload_param.buffer_size": "the disk store sizes its own buffers",
    "zero_optimization.offload_param.max_in_cpu": "the disk store sizes its own buffers",
    "optimizer.params.adam.torch_adam": "torch's Adam/AdamW kernels are always used",
    "activation_checkpointing.number_checkpoints": "it sizes deepspeed.checkpointing's buffers",
    "fp16.auto_cast": "the forward runs under torch.autocast",
    "checkpoint.tag_validation": "every rank saves under the one tag rank 0 chose",
}

# accepted at DeepSpeed's default (the value), refused otherwise
DEFAULT_ONLY: dict[str, Any] = {
    "wall_clock_breakdown": False, "prescale_gradients": False, "gradient_predivide_factor": 1.0,
    "optimizer.params.adam.amsgrad": False, "optimizer.params.sgd.nesterov": False,
    "optimizer.params.sgd.dampening": 0, "fp16.fp16_master_weights_and_grads": False,
    "fp16.consecutive_hysteresis": False,
    "zero_optimization.offload_optimizer.ratio": 1.0,
    "activation_checkpointing.partition_activations": False, "activation_checkpointing.cpu_checkpointing": False,
    "activation_checkpointing.contiguous_memory_optimization": False,
    "activation_checkpointing.synchronize_checkpoint_boundary": False, "activation_checkpointing.profile": False,
    "memory_breakdown": False, "dump_state": False, "sparse_gradients": False, "zero_force_ds_cpu_optimizer": True,
    "data_types.grad_accum_dtype": None, "checkpoint.load_universal": False,
    "checkpoint.use_node_local_storage": False, "checkpoint.parallel_write.pipeline_stage": False,
    "zero_optimization.cpu_offload": False, "zero_optimization.cpu_offload_params": False,
}

# DEFAULT_ONLY keys that DeepSpeed renamed: their refusal says what to write instead
RENAMED: dict[str, str] = {
    "zero_optimization.cpu_offload": 'zero_optimization.offload_optimizer: {"device": "cpu"}',
    "zero_optimization.cpu_offload_params": 'zero_optimization.offload_param: {"device": "cpu"} (stage 3)',
}

# DeepSpeed's own keys that this front door does not implement (refused as such, not as typos)
KNOWN_UNSUPPORTED = frozenset({
    "amp", "fp8", "torch_autocast", "flops_profiler", "comms_logger", "compression_training",
    "data_efficiency", "curriculum_learning", "elasticity", "pipeline", "sparse_attention", "aio",
    "nebula", "autotuning", "wandb", "csv_monitor", "comet", "dataloader_drop_last",
    "disable_allgather", "hybrid_engine", "weight_quantization",
    "compile", "zenflow", "timers", "eigenvalue", "progressive_layer_drop", "quantize_training", "mics_shard_size",
    "mics_hierarchical_params_gather", "sequence_parallel_size", "seq_parallel_communication_data_type",
    "use_data_before_expert_parallelism", "graph_harvesting", "load_universal_checkpoint", "fp32_reduce_scatter",
    "gradient_accumulation_dtype", "train_batch_size_per_gpu", "zero_optimization.elastic_checkpoint",
    "zero_optimization.load_from_fp32_weights", "zero_optimization.zero_quantized_weights",
    "zero_optimization.zero_quantized_gradients", "zero_optimization.zero_quantized_nontrainable_weights",
    "zero_optimization.mics_shard_size", "zero_optimization.memory_efficient_linear",
    "zero_optimization.stage3_module_granularity_threshold", "zero_optimization.use_multi_rank_bucket_allreduce",
    "zero_optimization.pipeline_loading_checkpoint", "zero_optimization.override_module_apply",
    "zero_optimization.log_trace_cache_warnings", "tensor_parallel.tp", "tensor_parallel.tp_overlap_comm",
    "tensor_parallel.tp_grain_size", "tensor_parallel.partition_config", "tensor_parallel.dtype",
})


def check_keys(block: str, given: Mapping[str, Any], shown: str | None = None) -> None:
    """Refuse any key of ``given`` (the block ``block`` of :data:`BLOCKS`) that is not read, in
    one line naming it (``shown``: the block as the user wrote it), the reason and what the block
    supports; a key refused at other than its default value (:data:`DEFAULT_ONLY`) likewise."""
    if not isinstance(given, Mapping):
        raise ConfigError(f"ds_config: {shown or block} must be a JSON object (a dict), not {given!r}")
    supported = BLOCKS[block]
    shown = block if shown is None else shown
    for key in given:
        path = f"{shown}.{key}" if shown else str(key)
        if not block and key in SWITCHED_OFF and _switched_off(given[key]):
            continue
        if key not in supported:
            raise ConfigError(_unsupported(block, str(key), path, supported))
        default_key = f"{block}.{key}" if block else key
        if default_key in DEFAULT_ONLY and given[key] != DEFAULT_ONLY[default_key] and given[key] != "auto":
            instead = f"write {RENAMED[default_key]} instead" if default_key in RENAMED else "remove it"
            raise ConfigError(f"ds_config: {path} = {given[key]!r} is not supported (only its default "
                              f"{DEFAULT_ONLY[default_key]!r}); {instead}")


def _switched_off(value: Any) -> bool:
    """A :data:`SWITCHED_OFF` block that is off: a JSON object whose ``enabled`` is false or absent
    (DeepSpeed's default for each of them)."""
    return isinstance(value, Mapping) and value.get("enabled", False) is False


def _unsupported(block: str, key: str, path: str, supported: Iterable[str]) -> str:
    known = (f"{block}.{key}" if block else key) in KNOWN_UNSUPPORTED
    names = ", ".join(supported)
    if known:
        off = f' ({path} is accepted switched off: "enabled": false)' if not block and key in SWITCHED_OFF else ""
        return f"ds_config: {path} is a DeepSpeed setting hybridpar does not implement; {_where(block)} supports {names}{off}"
    close = difflib.get_close_matches(key, list(supported), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"ds_config: unknown key {path}{hint}; {_where(block)} supports {names}"


def _where(block: str) -> str:
    return f"the {block.split('.params.')[0]} block" if block else "the top level"


def no_effect_keys(config: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The :data:`NO_EFFECT` keys present in ``config`` (a parsed ds_config), as dotted paths."""
    out: list[str] = []
    for key, value in config.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if path in NO_EFFECT:
            out.append(path)
        elif path in SWITCHED_OFF and _switched_off(value):
            out.append(f"{path} (switched off)")
        elif isinstance(value, Mapping) and path in ("zero_optimization", "zero_optimization.offload_optimizer",
                                                      "zero_optimization.offload_param", "activation_checkpointing",
                                                      "fp16", "checkpoint"):
            out += no_effect_keys(value, path)
    return out
