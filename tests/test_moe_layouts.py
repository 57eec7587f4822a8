"""Mixture of experts under every parallel layout equals one process (issue 19).

Same comparison and tolerances as :mod:`test_layouts` (losses to 1e-5 relative, weights to 1% of
lr x steps), on a small MoE model with unbalanced routing (a real router: nothing forces balance),
the load-balancing loss and z-loss on, so their gradients are part of what must agree."""

from __future__ import annotations

import functools

import pytest
import torch
from test_layouts import LR, STEPS, WEIGHT_ATOL
from test_trainer import SMALL

from hybridpar.config import load_config
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.training.trainer import Trainer

pytestmark = pytest.mark.numerics

MOE = ["--model.n_experts", "4", "--model.experts_per_token", "2", "--model.moe_ffn_hidden", "32",
       "--model.aux_loss_coef", "0.05", "--model.z_loss_coef", "0.01", "--model.n_layers", "4",
       "--model.n_kv_heads", "4"]

LAYOUTS = {
    "ep2": ["--parallel.dp", "2", "--parallel.ep", "2"],
    "ep4": ["--parallel.dp", "4", "--parallel.ep", "4"],
    "dp4-ep2": ["--parallel.dp", "4", "--parallel.ep", "2"],
    "tp2": ["--parallel.tp", "2"],
    "tp2-sp": ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"],
    "ep2-tp2": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.tp", "2"],
    "ep2-tp2-sp": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.tp", "2",
                   "--parallel.sequence_parallel", "true"],
    "cp2": ["--parallel.cp", "2"],
    "ep2-cp2": ["--parallel.cp", "2", "--parallel.ep", "2"],
    "ep2-pp2": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.pp", "2"],
    "ep2-zero1": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.zero_stage", "1"],
    "ep2-zero2": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.zero_stage", "2"],
    "ep2-recompute-full": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.recompute", "full"],
    "dp2-zero3": ["--parallel.dp", "2", "--parallel.zero_stage", "3"],
}


def config(tmp: str, layout: list[str], extra: tuple[str, ...] = ()):
    return load_config(None, [*SMALL, *MOE, "--train.lr", str(LR), "--train.run_dir", tmp, *extra, *layout])


def _run(rank: int, world: int, tmp: str, layout: list[str], extra: tuple[str, ...] = ()) -> dict:
    cfg = config(tmp, layout, extra)
    with ParallelDims.from_config(cfg.parallel).build("cpu") as topo:
        trainer = Trainer(cfg, topo)
        losses = [trainer.train_step(s).loss for s in range(1, STEPS + 1)]
        state = trainer.engine.full_state_dict()
        return {"losses": losses, "state": state if rank == 0 else None}


@functools.cache
def reference(tmp: str, extra: tuple[str, ...] = ()) -> dict:
    return _run(0, 1, tmp, [], extra)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_matches_single_process(name, dist_run, tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "moe_layouts")
    ref = reference(tmp)
    layout = LAYOUTS[name]
    world = config(tmp, layout).parallel.world_size
    results = dist_run(world, _run, tmp, layout)
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5), f"rank {rank}"
    assert set(results[0]["state"]) == set(ref["state"])
    for k, v in results[0]["state"].items():
        torch.testing.assert_close(v, ref["state"][k], rtol=0, atol=WEIGHT_ATOL, msg=lambda m, k=k: f"{k}: {m}")
