"""The ds_config schema (no process group): every row of docs/reference/errors.md's DeepSpeed table is
refused with its message, the batch arithmetic, the optimizer and precision mapping (DeepSpeed's
Adam is AdamW; a missing weight_decay is the class's default), Hugging Face's "auto" values,
DeepSpeed's LR schedule formulas, the calling-convention routing, and load_checkpoint's refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import hybridpar
from hybridpar.api.deepspeed import parse_ds_config
from hybridpar.api.deepspeed.checkpoint import resolve
from hybridpar.api.deepspeed.config import batch_sizes
from hybridpar.api.deepspeed.schedules import schedule_lrs
from hybridpar.api.front import _deepspeed_call
from hybridpar.config import ConfigError
from hybridpar.training.checkpoint import CheckpointError

DOC = Path(__file__).resolve().parents[1] / "docs" / "reference" / "errors.md"


def rows() -> list[tuple[str, str]]:
    table = DOC.read_text().split("## DeepSpeed front door", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`{"):
            out.append((cells[0].strip("`"), cells[1]))
    return out


def test_the_table_is_not_empty():
    assert len(rows()) >= 15


@pytest.mark.parametrize("config, message", rows())
def test_documented_message(config, message):
    with pytest.raises(ConfigError) as e:
        parse_ds_config(json.loads(config), world_size=2)
    assert len(str(e.value).splitlines()) == 1
    assert message in str(e.value)


@pytest.mark.parametrize("given, dp, expected", [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, 2, (16, 4, 2)),
    ({"train_batch_size": 16, "gradient_accumulation_steps": 2}, 2, (16, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
    ({"train_batch_size": 16}, 4, (16, 4, 1)),
    ({"train_micro_batch_size_per_gpu": 2}, 4, (8, 2, 1)),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2, (16, 4, 2)),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"},
     2, (16, 8, 1)),
])
def test_two_batch_keys_imply_the_third(given, dp, expected):
    assert batch_sizes(given, dp) == expected


def test_optimizer_and_precision_mapping():
    base = {"train_batch_size": 8}
    adam = parse_ds_config({**base, "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "torch_adam": True}}}, 2)
    assert (adam.engine.optimizer, adam.engine.lr, adam.engine.weight_decay) == ("adamw", 3e-4, 0.01)
    l2 = parse_ds_config({**base, "optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, 2)
    assert (l2.engine.optimizer, l2.engine.weight_decay) == ("adam", 0.0)
    sgd = parse_ds_config({**base, "optimizer": {"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9}}}, 2)
    assert (sgd.engine.optimizer, sgd.engine.momentum) == ("sgd", 0.9)
    fp16 = parse_ds_config({**base, "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 3}}, 2).engine
    assert (fp16.precision, fp16.loss_scale_init, fp16.loss_scale_hysteresis, fp16.loss_scale_window) == \
        ("fp16", 256.0, 3, 1000)
    assert parse_ds_config({**base, "fp16": {"enabled": True, "loss_scale": 128}}, 2).engine.loss_scale == 128.0
    assert parse_ds_config({**base, "bf16": {"enabled": True}}, 2).engine.precision == "bf16"
    zero = parse_ds_config({**base, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": 2**20, "stage3_prefetch_bucket_size": 0, "overlap_comm": True,
        "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}, 2)
    e = zero.engine
    assert (e.zero_stage, e.bucket_mb, e.zero3_prefetch, e.offload_optimizer, e.offload_params) == (3, 4.0, False, True, True)
    assert zero.no_effect == ["zero_optimization.overlap_comm"]


def test_hugging_face_auto_values():
    cfg = parse_ds_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_clipping": "auto",
                           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                                     "betas": "auto", "eps": "auto"}},
                           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_min_lr": "auto",
                                                                       "warmup_num_steps": "auto"}},
                           "bf16": {"enabled": "auto"},
                           "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, 2, hidden=64)
    e = cfg.engine
    assert (cfg.train_batch_size, e.grad_clip, e.lr, e.weight_decay, e.betas, e.precision) == \
        (4, 1.0, 5e-5, 0.0, (0.9, 0.999), "fp32")
    assert cfg.scheduler == ("WarmupLR", {"warmup_max_lr": 5e-5, "warmup_min_lr": 0.0, "warmup_num_steps": 0})
    assert e.bucket_mb == 64 * 64 * 4 / 2**20


def test_deepspeed_lr_schedules():
    """DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py) at iterations -1, 0, 4, 10, 15."""
    warm = {"warmup_min_lr": 0.1, "warmup_max_lr": 1.0, "warmup_num_steps": 10}
    assert schedule_lrs("WarmupLR", warm, [9.0], -1) == [0.1]
    assert schedule_lrs("WarmupLR", warm, [9.0], 0) == [0.1]
    assert schedule_lrs("WarmupLR", warm, [9.0], 4) == [pytest.approx(0.1 + 0.9 * math.log(5) / math.log(10))]
    assert schedule_lrs("WarmupLR", {**warm, "warmup_type": "linear"}, [9.0], 4) == [pytest.approx(0.1 + 0.9 * 0.4)]
    assert schedule_lrs("WarmupLR", warm, [9.0], 15) == [1.0]
    decay = {**warm, "total_num_steps": 20}
    assert schedule_lrs("WarmupDecayLR", decay, [9.0], 15) == [pytest.approx(0.1 + 0.9 * 5 / 10)]
    cosine = {"total_num_steps": 20, "warmup_num_steps": 10, "cos_min_ratio": 0.0}
    assert schedule_lrs("WarmupCosineLR", cosine, [2.0, 4.0], -1) == [0.0, 0.0]
    assert schedule_lrs("WarmupCosineLR", cosine, [2.0], 14) == [pytest.approx(2.0 * (1 + math.cos(math.pi * 0.5)) / 2)]


def test_calling_convention_routing():
    assert not _deepspeed_call({"zero_stage": 2, "gradient_accumulation_steps": 4})
    assert _deepspeed_call({"train_batch_size": 8})
    assert _deepspeed_call("ds_config.json")
    assert _deepspeed_call(None, None, None, None, None, None, None, {"train_batch_size": 8})
    with pytest.raises(ConfigError, match="both config= and config_params="):
        hybridpar.initialize(model=object(), config={"train_batch_size": 8}, config_params={"train_batch_size": 8})


def test_load_checkpoint_refuses_what_is_not_ours(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint directory .*zero_to_fp32.py"):
        resolve(tmp_path, None)
    ds = tmp_path / "ds"
    (ds / "global_step10").mkdir(parents=True)
    (ds / "latest").write_text("global_step10")
    (ds / "global_step10" / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is a DeepSpeed checkpoint .*cannot read yet; convert it with .*zero_to_fp32.py"):
        resolve(ds, None)
    with pytest.raises(CheckpointError, match="not a checkpoint written by save_checkpoint"):
        resolve(tmp_path, "nothing")


def test_initialize_refusals_before_any_process_group(monkeypatch):
    """errors.md's "outside the config" refusals, each one line, with no process group created."""
    import torch
    from test_autotp import make_model
    from test_deepspeed_api import gpt2

    model = gpt2()
    monkeypatch.setenv("WORLD_SIZE", "3")
    tp3 = {"train_batch_size": 8, "tensor_parallel": {"autotp_size": 3}}
    with pytest.raises(ConfigError, match="autotp_size = 3: AutoTP: tensor_parallel_size = 3 does not divide the "
                                          "model's num_attention_heads = 4"):
        hybridpar.initialize(model=make_model("llama"), config=tp3)
    with pytest.raises(ConfigError, match="autotp_size = 3: .* carries no tensor-parallel plan"):
        hybridpar.initialize(model=model, config=tp3)  # GPT-2 has no plan of its own
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = {"train_batch_size": 8, "optimizer": {"type": "AdamW"}}
    with pytest.raises(ConfigError, match="optimizer= was passed and the ds_config has an optimizer block"):
        hybridpar.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
    with pytest.raises(ConfigError, match="mpu="):
        hybridpar.initialize(model=model, mpu=object(), config=cfg)
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    with pytest.raises(ConfigError, match="lr_scheduler=<scheduler object>"):
        hybridpar.initialize(model=model, lr_scheduler=sched, config=cfg)
    with pytest.raises(ConfigError, match="not a parameter of model"):
        hybridpar.initialize(model=model, model_parameters=[torch.nn.Parameter(torch.zeros(2))], config=cfg)
    assert not torch.distributed.is_initialized()


def test_init_distributed_takes_deepspeeds_signature(monkeypatch):
    """``deepspeed.init_distributed(...)`` of a migrated script: dist_backend, timeout (a
    timedelta), init_method with rank and world_size; dist_init_required=False creates nothing;
    DeepSpeed's MPI and logging keywords are accepted without effect."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert hybridpar.init_distributed(dist_backend="gloo", dist_init_required=False) == (0, 1)
    assert hybridpar.init_distributed("gloo", auto_mpi_discovery=True, distributed_port=29500, verbose=False) == (0, 1)
    assert not dist.is_initialized()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        assert hybridpar.init_distributed(dist_backend="gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                          world_size=1, timeout=timedelta(seconds=30)) == (0, 1)
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert hybridpar.init_distributed(dist_backend="gloo") == (0, 1)  # idempotent
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def test_real_configs_with_switched_off_blocks_and_keys_at_their_defaults_are_accepted():
    """Issue 44: what DeepSpeed users' configs really hold. Blocks switched off and keys at their
    defaults change nothing, so they are accepted and named once among the keys without effect;
    switched on, a block is still refused."""
    off = {name: {"enabled": False} for name in ("flops_profiler", "wandb", "csv_monitor", "comms_logger",
                                                 "amp", "elasticity")}
    off["flops_profiler"].update(profile_step=1, module_depth=-1, top_modules=1, detailed=True, output_file=None)
    off["wandb"].update(group=None, team=None, project="deepspeed")
    config = {"train_batch_size": 8, **off, "memory_breakdown": False, "dump_state": False,
              "sparse_gradients": False, "zero_force_ds_cpu_optimizer": True,
              "data_types": {"grad_accum_dtype": None},
              "checkpoint": {"tag_validation": "Warn", "load_universal": False, "use_node_local_storage": False,
                             "parallel_write": {"pipeline_stage": False}},
              "zero_optimization": {"stage": 2, "cpu_offload": False}}
    ds = parse_ds_config(config, world_size=2)
    assert ds.engine.zero_stage == 2 and not ds.engine.offload_optimizer
    for name in off:
        assert f"{name} (switched off)" in ds.no_effect
    assert "checkpoint.tag_validation" in ds.no_effect
    with pytest.raises(ConfigError, match=r'flops_profiler is a DeepSpeed setting .* accepted switched off'):
        parse_ds_config({"train_batch_size": 8, "flops_profiler": {"enabled": True}}, world_size=2)
    with pytest.raises(ConfigError, match=r"memory_breakdown = True is not supported \(only its default False\)"):
        parse_ds_config({"train_batch_size": 8, "memory_breakdown": True}, world_size=2)
    with pytest.raises(ConfigError, match=r'write zero_optimization.offload_optimizer: \{"device": "cpu"\} instead'):
        parse_ds_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": True}}, world_size=2)
    with pytest.raises(ConfigError, match=r"data_types.grad_accum_dtype = 'bf16' is not supported"):
        parse_ds_config({"train_batch_size": 8, "data_types": {"grad_accum_dtype": "bf16"}}, world_size=2)
