"""The DeepSpeed front door (``import hybridpar as deepspeed``) on the issue's seed: a small tied-head
GPT-2 from a transformers config, the seed's loop, under 2 gloo processes at ZeRO 0-3 against our
own single process on the whole batch (per-step losses within numerics.LOSS_RTOL: the same math,
summed in another order); parameter groups as DeepSpeed means them; a checkpoint saved at dp2 x
ZeRO-2 that loads at dp1, at dp4 x ZeRO-3 and (a tied Llama) at tp2 by AutoTP, and continues on the
uninterrupted trajectory, with the client state round-tripped. DeepSpeed itself is not needed (benchmarks/deepspeed_peer.py
compares with it)."""

from __future__ import annotations

import pytest
import torch
from numerics import LOSS_RTOL

import hybridpar as deepspeed

pytestmark = pytest.mark.numerics

STEPS, GLOBAL, SEQ = 3, 4, 16


def gpt2(tied: bool = True) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def ds_config(stage: int) -> dict:
    return {"train_batch_size": GLOBAL, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1, "torch_adam": True}},
            "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}, "steps_per_print": 1000}


def train_dataloader(engine, steps: range) -> list[dict]:
    """A fixed batch stream: step s's global batch, this dp rank's rows."""
    dp = engine.topo.dp
    rows = GLOBAL // dp.size
    out = []
    for s in steps:
        ids = torch.randint(0, 256, (GLOBAL, SEQ), generator=torch.Generator().manual_seed(100 + s))
        mine = ids[dp.rank * rows:(dp.rank + 1) * rows]
        out.append({"input_ids": mine, "labels": mine})
    return out


def loop(model_engine, steps: range) -> list[float]:
    """The seed's loop; the loss averaged over dp (what one process on the whole batch sees)."""
    losses = []
    for batch in train_dataloader(model_engine, steps):
        loss = model_engine(**batch).loss
        model_engine.backward(loss)
        model_engine.step()
        mean = model_engine.topo.comm.all_reduce(loss.detach().clone(), model_engine.topo.dp, op="avg")
        losses.append(float(mean))
    return losses


def _seed(rank: int, world: int, stage: int) -> list[float]:
    model = gpt2()
    model_engine, optimizer, _, _ = deepspeed.initialize(model=model, config_params=ds_config(stage))
    assert optimizer is model_engine.optimizer and model_engine.train_micro_batch_size_per_gpu() == GLOBAL // world
    try:
        return loop(model_engine, range(STEPS))
    finally:
        model_engine.close()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_seed_dp2_matches_single_process(dist_run, stage):
    reference = _seed(0, 1, 0)
    for losses in dist_run(2, _seed, stage):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=LOSS_RTOL, atol=0)


def test_parameter_groups_as_deepspeed_means_them():
    """A plain model.parameters() decays everything; groups keep their own weight decay."""
    model = gpt2()
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(0))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1]
    engine.close()
    model = gpt2()
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2]},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config(0))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    engine.close()


def _model(family: str) -> torch.nn.Module:
    """The untied GPT-2 (no tensor-parallel plan) or test_autotp's tiny tied Llama (has one)."""
    if family == "gpt2":
        return gpt2(tied=False)
    from test_autotp import make_model

    return make_model(family)


def _train_save(rank: int, world: int, path: str, family: str = "gpt2") -> dict:
    engine, *_ = deepspeed.initialize(model=_model(family), config=ds_config(2))
    try:
        before = loop(engine, range(2))
        engine.save_checkpoint(path, client_state={"epoch": 7, "seen": torch.arange(3)})
        after = loop(engine, range(2, STEPS))
        return {"before": before, "after": after}
    finally:
        engine.close()


def _load_continue(rank: int, world: int, path: str, stage: int, family: str = "gpt2", autotp: int = 1) -> dict:
    torch.manual_seed(5)
    cfg = {**ds_config(stage), "train_batch_size": GLOBAL}
    if autotp > 1:
        cfg["tensor_parallel"] = {"autotp_size": autotp}
    engine, *_ = deepspeed.initialize(model=_model(family), config=cfg)
    try:
        where, client = engine.load_checkpoint(path)
        assert where.endswith("global_step2") and engine.global_steps == 2
        assert client["epoch"] == 7 and torch.equal(client["seen"], torch.arange(3))
        return {"after": loop(engine, range(2, STEPS)), "tp": engine.topo.tp.size}
    finally:
        engine.close()


def test_checkpoint_dp2_zero2_resumes_at_dp1_and_dp4_zero3(dist_run, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = dist_run(2, _train_save, path)[0]
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
    for resumed in (_load_continue(0, 1, path, 0), dist_run(4, _load_continue, path, 3)[0]):
        torch.testing.assert_close(torch.tensor(resumed["after"]), torch.tensor(saved["after"]), rtol=LOSS_RTOL, atol=0)


def test_checkpoint_dp2_zero2_resumes_at_tp2_autotp(dist_run, tmp_path):
    """The tied Llama saved at dp2 x ZeRO-2 without tensor parallelism, loaded at tp2 (AutoTP from
    its plan via ``tensor_parallel.autotp_size``, dp1): each rank reads its shard of the saved whole
    weights and Adam moments and continues on the uninterrupted trajectory."""
    path = str(tmp_path / "ckpt")
    saved = dist_run(2, _train_save, path, "llama")[0]
    for resumed in dist_run(2, _load_continue, path, 0, "llama", 2):
        assert resumed["tp"] == 2
        torch.testing.assert_close(torch.tensor(resumed["after"]), torch.tensor(saved["after"]), rtol=LOSS_RTOL, atol=0)


def test_fp16_overflow_skips_the_step_and_hysteresis_delays_the_backoff():
    """Loss scale 2**40 overflows fp16 gradients: the step is skipped (weights unchanged, the
    LR schedule not advanced, global_steps counted, as DeepSpeed), and with hysteresis 2 the scale
    halves only at the second overflow."""
    model = gpt2()
    cfg = {**ds_config(0), "fp16": {"enabled": True, "initial_scale_power": 40, "hysteresis": 2}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loop(engine, range(1))
    assert (engine.global_steps, engine.skipped_steps, engine.was_step_applied()) == (1, 1, False)
    assert engine.loss_scale == 2.0**40
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    loop(engine, range(1, 2))
    assert engine.skipped_steps == 2 and engine.loss_scale == 2.0**39
    engine.close()


def test_bf16_runs_within_bf16_rounding_of_fp32():
    """bf16 (autocast) against fp32 on one process: per-step losses within 2 (2 layers + 1) u,
    u = 2**-8, the bound benchmarks/deepspeed_peer.py derives."""
    fp32 = _seed(0, 1, 0)
    engine, *_ = deepspeed.initialize(model=gpt2(), config={**ds_config(0), "bf16": {"enabled": True}})
    bf16 = loop(engine, range(STEPS))
    engine.close()
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(fp32), rtol=2 * (2 * 2 + 1) * 2.0**-8, atol=0)


def _pipeline(rank: int, world: int) -> list[float]:
    import torch.nn.functional as F
    from test_api_pipeline import CLIP, HID, OPT, M, batch, make_layers
    from test_api_pipeline import GLOBAL as PGLOBAL
    from test_api_pipeline import STEPS as PSTEPS

    from hybridpar.distributed.mesh import ParallelDims

    with ParallelDims(pp=2).build() as topo:
        pipe = deepspeed.PipelineModule(layers=make_layers(), topo=topo, num_microbatches=M, loss_fn=F.mse_loss,
                                        activation_shape=(PGLOBAL // M, HID))
        cfg = {"train_micro_batch_size_per_gpu": PGLOBAL // M, "gradient_accumulation_steps": M,
               "gradient_clipping": CLIP, "optimizer": {"type": "AdamW", "params": {
                   "lr": OPT["lr"], "betas": list(OPT["betas"]), "weight_decay": OPT["weight_decay"]}}}
        engine, *_ = deepspeed.initialize(model=pipe, config=cfg)
        losses = []
        for step in range(PSTEPS):
            x, y = batch(step)
            losses.append(float(engine.train_batch(iter(zip(x.chunk(M), y.chunk(M), strict=True)))))
        return losses


def test_pipeline_module_train_batch_matches_single_process(dist_run):
    from test_api_pipeline import reference

    for losses in dist_run(2, _pipeline):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference()[0]), rtol=LOSS_RTOL, atol=0)


def test_client_optimizer_and_scheduler_callable():
    """optimizer= (a torch AdamW on the model's parameters) trains as the same optimizer block; a
    callable lr_scheduler= is built on the engine's optimizer and stepped once per optimizer step."""
    reference = _seed(0, 1, 0)
    model = gpt2()
    client = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    cfg = {k: v for k, v in ds_config(0).items() if k != "optimizer"}
    engine, _, _, sched = deepspeed.initialize(
        model=model, optimizer=client, config=cfg,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0))
    losses = loop(engine, range(STEPS))
    assert sched.last_epoch == STEPS and engine.get_lr() == [1e-3]
    engine.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=LOSS_RTOL, atol=0)
