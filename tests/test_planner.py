"""Planner: memory model against published numbers and the runtime's tensors, search, CLI."""

from __future__ import annotations

import json

import pytest
import torch

from hybridpar.config import Config, ModelConfig, ParallelConfig, TrainConfig, model_preset
from hybridpar.planner.machine.hardware import GPUS, Cluster, PlanError, gpu_spec
from hybridpar.planner.memory.plan import (
    korthikanti_layer_bytes,
    layer_activation_bytes,
    model_state_bytes,
)
from hybridpar.planner.model.layout import BlockStyle, Layout, Workload, parse_layout
from hybridpar.planner.model.shapes import numel, rank_param_shapes


def test_zero_paper_model_states():
    """ZeRO (Rajbhandari et al. 2020), figure 1: 7.5B parameters, Adam, mixed precision, 64 GPUs."""
    shapes = [(7_500_000_000,)]
    gb = [sum(vars(model_state_bytes(shapes, 64, z, param_bytes=2)).values()) / 1e9 for z in range(4)]
    assert gb[0] == pytest.approx(120.0)
    assert round(gb[1], 1) == 31.4
    assert round(gb[2], 1) == 16.6
    assert round(gb[3], 1) == 1.9


@pytest.mark.parametrize("t,sp,rec", [(1, False, "none"), (8, False, "none"), (8, True, "none"),
                                      (8, False, "selective"), (8, True, "selective"), (8, True, "full")])
def test_korthikanti_formulas(t, sp, rec):
    """Korthikanti et al. 2022, Table 2, and our term-by-term GPT accounting agree exactly."""
    s, b, h, a = 2048, 1, 3072, 32
    sbh = s * b * h
    expected = {("none", False): sbh * (10 + 24 / t + 5 * a * s / (h * t)),
                ("none", True): sbh * (34 / t + 5 * a * s / (h * t)),
                ("selective", False): sbh * (10 + 24 / t),
                ("selective", True): sbh * 34 / t,
                ("full", True): 2 * sbh / t}[(rec, sp)]
    if t == 1:
        assert expected == sbh * (34 + 5 * a * s / h)
    assert korthikanti_layer_bytes(s, b, h, a, t, sp, rec) == pytest.approx(expected)
    gpt = ModelConfig(dim=h, n_layers=2, n_heads=a, n_kv_heads=a, ffn_hidden=8 * h // 3, vocab_size=100)
    layout = Layout(tp=t, sequence_parallel=sp, recompute=rec, micro_batch=b)
    work = Workload(b, s, "fp16", style=BlockStyle.MEGATRON)
    assert layer_activation_bytes(gpt, layout, work) == pytest.approx(expected)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_model_states_equal_runtime_tensors_world1():
    """dp=1 Engine: live parameter, gradient and AdamW state bytes equal the prediction."""
    from hybridpar.distributed.mesh import ParallelDims
    from hybridpar.training.engine import Engine

    cfg = Config(parallel=ParallelConfig(), train=TrainConfig(global_batch=2, micro_batch=2, seq_len=16))
    with ParallelDims.from_config(cfg.parallel).build("cpu") as topo:
        eng = Engine(cfg, topo, torch.device("cpu"))
        x = torch.randint(0, cfg.model.vocab_size, (2, 17))
        eng.forward_backward([(x[:, :-1], x[:, 1:])], 1.0)
        eng.optimizer.step()
        states = [v for st in eng.optimizer.state.values() for k, v in st.items() if k != "step"]
        pred = model_state_bytes(rank_param_shapes(cfg.model, 1, 1, 1, 0), 1, 0, param_bytes=4)
        assert _bytes(eng.params) == pred.params
        assert _bytes(q.grad for q in eng.params) == pred.grads
        assert _bytes(states) == pred.optimizer


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_rank_params_equal_stage_modules(tied):
    """pp=2 (and V=2): each rank's predicted parameters are exactly its stage modules' tensors
    (a tied embedding's mirror included), built in-process without a process group."""
    from hybridpar.models.llama import Llama, LlamaChunk
    from hybridpar.parallel.pipeline.stages import build_stage_modules

    model_cfg = model_preset("tiny")
    model_cfg.tie_embeddings = tied
    model = Llama(model_cfg)
    for v in (1, 2):
        for rank in range(2):
            chunks = build_stage_modules(model, LlamaChunk, rank, 2, v)
            params = {id(q): q for c in chunks for q in c.parameters()}.values()
            assert sum(q.numel() for q in params) == numel(rank_param_shapes(model_cfg, 1, 2, v, rank))


def test_tp_shapes_pad_vocab_and_split_heads():
    m = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, vocab_size=257)
    full, half = numel(rank_param_shapes(m, 1, 1, 1, 0)), numel(rank_param_shapes(m, 2, 1, 1, 0))
    assert full == m.num_params()
    norms = m.dim * (2 * m.n_layers + 1)
    assert half == (full - norms - 2 * 257 * 64) // 2 + norms + 2 * 129 * 64


def test_worst_stage_and_interleaving_factor():
    from hybridpar.planner.memory.plan import plan_memory

    m, w = model_preset("llama3-70b"), Workload(64, 4096)
    one = plan_memory(m, Layout(dp=1, tp=8, pp=8, micro_batch=1, sequence_parallel=True), w)
    inter = plan_memory(m, Layout(dp=1, tp=8, pp=8, micro_batch=1, sequence_parallel=True,
                                  pipeline_schedule="interleaved", virtual_stages=2), w)
    assert one.worst_rank == 0 and one.in_flight == 8
    # Narayanan et al. 2021: interleaving stores (1 + (p-1)/(p v)) times 1F1B's first stage
    ratio = inter.in_flight * (80 // 16) / (one.in_flight * (80 // 8))
    assert ratio == pytest.approx(1 + 7 / 16)


def test_hardware_names_and_toml(tmp_path):
    with pytest.raises(PlanError, match="H100-SXM"):
        gpu_spec("V100")
    assert gpu_spec("h100-sxm") is GPUS["H100-SXM"]
    f = tmp_path / "my.toml"
    f.write_text('[gpu]\nbase = "A100-80GB"\nname = "mine"\nhbm_bytes = 1e10\n')
    spec = gpu_spec(str(f))
    assert spec.name == "mine" and spec.hbm_bytes == 1e10 and spec.bf16_flops == 312e12
    c = Cluster.of(spec, 16, 8)
    assert c.axis_bandwidth(8, 1)[2] and not c.axis_bandwidth(2, 8)[2]


def test_search_recovers_rules_of_thumb():
    """llama3-70b on 4 nodes of 8 H100: tp stays inside a node, pp (if any) spans nodes."""
    from hybridpar.planner.search.search import search

    cluster = Cluster.of(GPUS["H100-SXM"], 32, 8)
    res = search(model_preset("llama3-70b"), Workload(64, 4096), cluster)
    assert res.ranked
    for ev in res.ranked[:3]:
        L = ev.layout
        assert L.tp <= 8
        if L.pp > 1:
            assert not cluster.axis_bandwidth(L.pp, L.tp * L.cp * L.dp)[2]
    assert "n_kv_heads" in " ".join(res.rejected_rules)  # tp = 16, 32 broke the GQA rule


def test_plan_cli_json_and_layout(capsys):
    from hybridpar.cli import main

    rc = main(["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "16", "--seq-len", "2048",
               "--json", "--layout", "dp=2,tp=4,pp=1,cp=1"])
    doc = json.loads(capsys.readouterr().out)
    lay = doc["layout"]
    for key in ("dp", "tp", "pp", "cp", "zero_stage", "pipeline_schedule", "micro_batch", "recompute",
                "memory_gib", "fits", "step_time_s", "mfu", "tflops_per_gpu", "tokens_per_s"):
        assert key in lay
    assert rc == 0 and lay["fits"] and 0 < lay["mfu"] < 1 and "total" in lay["memory_gib"]
    assert parse_layout("parallel.dp=2,micro_batch=4,sequence_parallel=true") == {
        "dp": 2, "micro_batch": 4, "sequence_parallel": True}
    assert main(["plan", "--model", "nope", "--gpus", "8", "--global-batch", "8", "--seq-len", "128"]) == 2
    assert "llama3-8b" in capsys.readouterr().err


def test_interleaving_with_uneven_stages_405b(capsys):
    """Llama 3 405B's 126 layers do not divide into pp = 16 x V chunks; the search still tries the
    interleaved schedule (the partition is uneven and its imbalance priced), and on Llama 3's own
    layout (tp 8, pp 16, dp 128) it beats 1F1B by a smaller bubble."""
    from hybridpar.cli import main
    from hybridpar.planner.search.search import schedules

    model = model_preset("llama3-405b")
    assert model.n_layers % 32 and ("interleaved", 2) in schedules(model, 16, 128)
    rc = main(["plan", "--model", "llama3-405b", "--gpu", "H100-SXM", "--gpus", "16384", "--global-batch",
               "2048", "--seq-len", "8192", "--json", "--layout", "dp=128,tp=8,pp=16,cp=1"])
    lay = json.loads(capsys.readouterr().out)["layout"]
    assert rc == 0 and lay["fits"] and lay["pipeline_schedule"] == "interleaved" and lay["virtual_stages"] > 1


def test_plan_says_why_its_best_layout_wins(capsys):
    """The search's best layout comes with its reasons: the margin over the runner-up (the same
    numbers as the table), the pipeline partition (the runtime's, with uneven layer counts) and
    the other schedules on the same axes, each slower than the chosen one."""
    from hybridpar.cli import main
    from hybridpar.planner.model.layout import model_key
    from hybridpar.planner.model.shapes import layer_partition

    rc = main(["plan", "--model", "llama3-70b", "--gpu", "H100-SXM", "--gpus", "64", "--global-batch", "64",
               "--seq-len", "4096", "--json", "--top", "3"])
    doc = json.loads(capsys.readouterr().out)
    best, runner_up = doc["layouts"][:2]
    why = doc["why"]
    assert rc == 0 and why[0].startswith(f"why dp={best['dp']},tp={best['tp']},pp={best['pp']},cp={best['cp']} ")
    assert f"{best['step_time_s']:.3f} s per step" in why[0] and f"{runner_up['step_time_s']:.3f} s (+" in why[0]
    if best["pp"] > 1:
        part = layer_partition(model_key(model_preset("llama3-70b")), best["pp"], best["virtual_stages"],
                               best["pipeline_schedule"] == "zbv")
        stages = next(x for x in why if x.strip().startswith("stages:"))
        assert f"80 layers in {len(part.chunks)} chunks" in stages
        schedule = next(x for x in why if x.strip().startswith("schedule:"))
        times = [float(t.split(" s (")[0].rsplit(" ", 1)[1]) for t in schedule.split("on the same axes ")[1].split("; ")]
        assert times and min(times) >= best["step_time_s"]


def test_plan_layout_explains_uneven_stages_405b(capsys):
    from hybridpar.cli import main

    rc = main(["plan", "--model", "llama3-405b", "--gpu", "H100-SXM", "--gpus", "16384", "--global-batch",
               "2048", "--seq-len", "8192", "--layout", "dp=32,tp=4,pp=16,cp=8,pipeline_schedule=interleaved,"
               "virtual_stages=4"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "stages: 126 layers in 64 chunks (126 does not divide by 64)" in out
    assert "schedule: interleaved x4, bubble" in out and "on the same axes 1f1b" in out


@pytest.mark.parametrize("preset,seq,batch", [("llama3-405b", 8192, 2048), ("llama3.1-405b", 131072, 128)])
def test_plan_states_the_scale_axes_405b(capsys, preset, seq, batch):
    """Llama 3 405B on 16,384 H100s, at 8k and at the 128k-token row: the plan says which ZeRO
    group size (dp_shard), cp mode and activation offload it chose, each against the numbers of
    the alternatives it priced (issue 32)."""
    from hybridpar.cli import main

    rc = main(["plan", "--model", preset, "--gpu", "H100-SXM", "--gpus", "16384", "--global-batch", str(batch),
               "--seq-len", str(seq), "--json", "--top", "1"])
    doc = json.loads(capsys.readouterr().out)
    best, why = doc["layouts"][0], "\n".join(doc["why"])
    assert rc == 0 and best["fits"]
    shard = best["dp_shard"] or best["dp"] * best["cp"]
    assert f"dp_shard={shard}:" in why and "hybrid sharding dp_shard=" in why
    if best["cp"] > 1:
        assert f"cp_mode {best['cp_mode']}" in why and "ring " in why.split("cp_mode", 1)[1]
    assert "activation offload: " + ("off" if not best["offload_activations"] else "") in why
