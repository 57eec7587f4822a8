"""DeepSpeed's common names beyond initialize (issue 44): ``add_config_arguments``,
``deepspeed.comm``, ``deepspeed.zero.Init`` / ``GatheredParameters``, ``deepspeed.pipe``'s
``PipelineModule`` / ``LayerSpec``, and the engine's ``local_rank``, ``mp_world_size`` and
``save_16bit_model``; checked against torch's own answers and the model's own weights."""

from __future__ import annotations

import argparse

import pytest
import torch
from test_deepspeed_api import ds_config, gpt2, loop

import hybridpar as deepspeed


def test_add_config_arguments_takes_deepspeeds_flags_and_initialize_reads_them(tmp_path):
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(tmp_path / "ds.json")])
    assert args.deepspeed is True and args.deepspeed_config == str(tmp_path / "ds.json")
    with pytest.raises(Exception, match="ds.json"):  # initialize(args=) reads that file (absent here)
        deepspeed.initialize(model=torch.nn.Linear(2, 2), args=args)


def test_the_submodules_are_there_under_deepspeeds_names():
    import torch.distributed as dist

    assert deepspeed.comm.get_rank is dist.get_rank and deepspeed.comm.all_reduce is dist.all_reduce
    assert deepspeed.comm.init_distributed is deepspeed.init_distributed
    assert deepspeed.pipe.PipelineModule is deepspeed.PipelineModule
    layer = deepspeed.pipe.LayerSpec(torch.nn.Linear, 3, 4, bias=False).build()
    assert isinstance(layer, torch.nn.Linear) and layer.weight.shape == (4, 3) and layer.bias is None
    with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
        model = torch.nn.Linear(3, 4)
    assert model.weight.shape == (4, 3)  # built whole: initialize shards it


def test_layer_specs_build_only_this_ranks_layers():
    from hybridpar import ParallelDims

    built: list[int] = []

    class Counted(torch.nn.Linear):
        def __init__(self, i: int) -> None:
            built.append(i)
            super().__init__(4, 4)

    specs = [deepspeed.pipe.LayerSpec(Counted, i) for i in range(4)]
    with ParallelDims().build() as topo:
        pipe = deepspeed.pipe.PipelineModule(layers=specs, topo=topo, num_microbatches=1,
                                             loss_fn=torch.nn.functional.mse_loss, activation_shape=(2, 4))
    assert built == [0, 1, 2, 3] and len(pipe.layers) == 4  # pp1: this rank holds all four


def _zero3(rank: int, world: int, tmp: str) -> dict:
    with deepspeed.zero.Init():
        model = gpt2()
    wte = model.transformer.wte.weight
    with deepspeed.zero.GatheredParameters(wte, modifier_rank=0):
        if rank == 0:
            wte.data.mul_(0.5)  # only rank 0 edits: the broadcast gives every rank its values
    first = wte.detach().clone()
    cfg = {**ds_config(3), "bf16": {"enabled": True}}
    engine, *_ = deepspeed.initialize(model=model, config_params=cfg)
    try:
        loop(engine, range(1))
        full = engine.full_state_dict()
        engine.save_16bit_model(tmp, "m.bin")
        engine.topo.comm.barrier()
        saved = torch.load(f"{tmp}/m.bin")
        return {"first": first, "local_rank": engine.local_rank, "mp": engine.mp_world_size,
                "full": {k: v.clone() for k, v in full.items()}, "saved": saved}
    finally:
        engine.close()


def test_zero3_engine_names_and_save_16bit_model(dist_run, tmp_path):
    out = dist_run(2, _zero3, str(tmp_path))
    torch.testing.assert_close(out[0]["first"], out[1]["first"], rtol=0, atol=0)
    torch.testing.assert_close(out[0]["first"], gpt2().transformer.wte.weight.detach() * 0.5, rtol=0, atol=0)
    assert [o["local_rank"] for o in out] == [0, 1] and [o["mp"] for o in out] == [1, 1]
    saved, full = out[0]["saved"], out[0]["full"]
    assert saved.keys() == full.keys()
    for k, v in full.items():
        assert saved[k].dtype == torch.bfloat16 and saved[k].shape == v.shape, k
        assert torch.equal(saved[k], v.to(torch.bfloat16)), k
