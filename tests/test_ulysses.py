"""Ulysses and hybrid (USP) context parallelism against one process, and their traffic against the planner.

Layouts (``parallel.cp_mode``): Ulysses cp2 and cp4 (cp4 on the small model's 2 KV heads: each
replicated twice), hybrid 2 x 2 (Ulysses pairs, ring across), Ulysses with tp2 + SP (and selective
recomputation) and with pp2 (and ZeRO-1, full recomputation); each with and without document masks;
and MoE with ep2 carved out of Ulysses cp2. Losses and weights equal one process by the layout
tolerance rule (:mod:`numerics`); a Ulysses checkpoint continues under ring attention on the same
trajectory; the comm counter's bytes per axis of a training step equal
:func:`hybridpar.planner.price.traffic.comm_bytes_per_axis`; the planner prices every cp mode and keeps
the fastest. Tests are ordered by world size so the worker pools are reused.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from layouts import Run, assert_trains_like, make_config, reference, train_layout, trainer_for
from numerics import layout_weight_atol
from test_document_mask import masked_run
from test_layouts import LR, MODEL, STEPS

from hybridpar.planner.model.layout import from_config
from hybridpar.planner.price.traffic import comm_bytes_per_axis

pytestmark = pytest.mark.numerics  # layout equality: also run under other ATEN_CPU_CAPABILITY (Makefile)

WEIGHT_ATOL = layout_weight_atol(LR, STEPS)
ULYSSES = ("--parallel.cp_mode", "ulysses")
HYBRID = ("--parallel.cp_mode", "hybrid", "--parallel.cp_ulysses", "2")
LAYOUTS = {  # world 2, then world 4
    "ulysses-cp2": ["--parallel.cp", "2", *ULYSSES],
    "ulysses-cp4": ["--parallel.cp", "4", *ULYSSES],
    "hybrid-2x2": ["--parallel.cp", "4", *HYBRID],
    "ulysses-cp2-tp2-sp-recompute": ["--parallel.cp", "2", *ULYSSES, "--parallel.tp", "2",
                                     "--parallel.sequence_parallel", "true", "--parallel.recompute", "selective"],
    "ulysses-cp2-pp2-zero1-recompute": ["--parallel.cp", "2", *ULYSSES, "--parallel.pp", "2", "--parallel.zero_stage",
                                        "1", "--parallel.recompute", "full"],
}
# the small model's 2 KV heads (test_layouts' MODEL has 4): Ulysses cp4 replicates each twice
BASE = {"ulysses-cp4": ()}


def test_ulysses_all_to_all_is_its_own_adjoint_inverse(dist_run):
    """heads_to_seq(seq_to_heads(x)) = x, seq_to_heads gathers every rank's tokens for its heads,
    and the backward of each is the other (<dy, S x> = <S^T dy, x>)."""
    dist_run(2, _all_to_all_roundtrip)


def _all_to_all_roundtrip(rank: int, world: int) -> None:
    from hybridpar.distributed.mesh import ParallelDims
    from hybridpar.parallel.ulysses import heads_to_seq, seq_to_heads

    with ParallelDims(cp=world).build() as topo:
        full = torch.randn(2, 4, 6 * world, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        x = full[:, :, 6 * rank:6 * (rank + 1)].clone().requires_grad_(True)
        y = seq_to_heads(x, topo.cp)
        torch.testing.assert_close(y, full[:, 2 * rank:2 * (rank + 1)], rtol=0, atol=0)
        torch.testing.assert_close(heads_to_seq(y, topo.cp), x, rtol=0, atol=0)
        dy = torch.randn_like(y)
        y.backward(dy)
        expect = heads_to_seq(dy, topo.cp)
        torch.testing.assert_close(x.grad, expect, rtol=0, atol=0)


def _layout_run(tmp: str, name: str) -> Run:
    return Run(tmp, (*BASE.get(name, MODEL), *LAYOUTS[name]))


def test_ulysses_with_expert_parallelism_matches_single_process(tmp_path_factory):
    """MoE layers with ep2 carved out of a Ulysses cp2 (the experts' token counts sum over cp as
    under ring): same losses and weights as one process."""
    from test_moe_layouts import MOE

    tmp = str(tmp_path_factory.getbasetemp() / "moe_layouts")
    results = train_layout(Run(tmp, (*MOE, "--parallel.cp", "2", *ULYSSES, "--parallel.ep", "2")))
    assert_trains_like(results, reference(Run(tmp, MOE)), atol=WEIGHT_ATOL, same_keys=True)


@pytest.mark.parametrize("saved, loaded", [("ulysses-cp2", ["--parallel.cp", "2"]),
                                           ("hybrid-2x2", ["--parallel.cp", "2"])])
def test_ulysses_checkpoint_continues_under_ring(saved, loaded, tmp_path):
    """Saved at step 2 under Ulysses (or hybrid), continued under ring attention: the same losses
    and weights as one process never changing layout."""
    ref = reference(Run(str(tmp_path / "ref"), MODEL))
    train_layout(Run(str(tmp_path), (*MODEL, *LAYOUTS[saved]), steps=2, save_at=2))
    results = train_layout(Run(str(tmp_path), (*MODEL, *loaded), resume_from=2))
    assert results[0].start == 2
    assert_trains_like(results, ref, atol=WEIGHT_ATOL)


@pytest.mark.parametrize("name, docs", [(n, d) for n in LAYOUTS for d in (False, True)],
                         ids=[f"{n}-{'documents' if d else 'plain'}" for n in LAYOUTS for d in (False, True)])
def test_ulysses_layout_matches_single_process(name, docs, tmp_path_factory):
    if docs:
        tmp = str(tmp_path_factory.getbasetemp() / "docmask")
        ref = reference(masked_run(tmp))
        assert_trains_like(train_layout(masked_run(tmp, LAYOUTS[name])), ref, atol=None)
        return
    tmp = str(tmp_path_factory.getbasetemp() / "ulysses")
    run = _layout_run(tmp, name)
    expected = reference(Run(tmp, BASE.get(name, MODEL)))
    assert_trains_like(train_layout(run), expected, atol=WEIGHT_ATOL)


TRAFFIC = {2: ["ulysses-cp2"], 4: ["ulysses-cp4", "hybrid-2x2", "ulysses-cp2-tp2-sp-recompute",
                                   "ulysses-cp2-pp2-zero1-recompute"]}


def _count(rank: int, world: int, tmp: str, names: list[str]) -> dict[str, tuple[int, int, dict[str, int]]]:
    """Per layout: (pp rank, dp x cp rank, payload bytes per axis of one step after a warm-up)."""
    out = {}
    for name in names:
        with trainer_for(_layout_run(tmp, name).config()) as trainer:
            trainer.train_step(1)
            counter = trainer.topo.comm.counter
            counter.reset()
            trainer.train_step(2)
            axes = {key.split("/")[1] for key in counter.snapshot()}
            out[name] = (trainer.topo.pp.rank, trainer.topo.dp_cp.rank,
                         {a: counter.bytes(axis=a) for a in axes if counter.bytes(axis=a)})
    return out


@pytest.mark.parametrize("world", sorted(TRAFFIC, reverse=True))
def test_ulysses_comm_bytes_equal_planner(world, tmp_path):
    """The comm counter's payload bytes per axis (Ulysses all-to-alls on cp / cp.ulysses, the
    ring's K/V on cp.ring) equal the planner's, exactly, on every rank."""
    counted = run_distributed(world, _count, str(tmp_path), TRAFFIC[world], timeout=600)
    for name in TRAFFIC[world]:
        cfg = _layout_run(str(tmp_path), name).config()
        layout, work = from_config(cfg)
        assert layout.cp_mode == cfg.parallel.cp_mode
        for rank, per_rank in enumerate(counted):
            pp_rank, zero_rank, got = per_rank[name]
            predicted = comm_bytes_per_axis(cfg.model, layout, work, pp_rank, zero_rank=zero_rank)
            assert predicted == got, f"{name} rank {rank}"
            assert any(axis.startswith("cp") for axis in got), name


def test_config_refuses_bad_ulysses_degrees(tmp_path):
    from hybridpar.config import ConfigError

    with pytest.raises(ConfigError, match="cp_ulysses >= 2 dividing parallel.cp = 4"):
        make_config(str(tmp_path), "--parallel.cp", "4", "--parallel.cp_mode", "hybrid", "--parallel.cp_ulysses", "3")
    with pytest.raises(ConfigError, match="not divisible by the Ulysses degree 4"):
        make_config(str(tmp_path), "--parallel.cp", "4", *ULYSSES, "--parallel.tp", "2")  # 2 heads per tp rank


# ----------------------------------------------------------------------------- the planner's choice


def _long_llama(name: str):
    import dataclasses

    from hybridpar.config import model_preset

    return dataclasses.replace(model_preset(name), max_seq_len=1 << 20)


def test_planner_prices_every_cp_mode_and_keeps_the_fastest():
    """On 16 H100s (2 nodes) with cp8 across them, llama3-8b at 4k tokens: every legal mode is
    priced, the search's layout carries the fastest (a hybrid: the ring's hops to the other node
    are no longer hidden behind attention, the all-to-alls stay smaller), and a fixed cp_mode stands."""
    from hybridpar.planner.machine.hardware import Cluster, gpu_spec
    from hybridpar.planner.model.layout import Layout, Workload
    from hybridpar.planner.search.cp_modes import layer_seconds, modes
    from hybridpar.planner.search.search import complete

    model, cluster, work = _long_llama("llama3-8b"), Cluster.of(gpu_spec("H100-SXM"), 16, 8), Workload(64, 4096)
    axes = {"dp": 2, "tp": 1, "pp": 1, "cp": 8}
    priced = {(c.cp_mode, c.cp_ulysses): layer_seconds(model, c, work, cluster)
              for c in modes(model, Layout(**axes, micro_batch=1))}
    assert set(priced) == {("ring", 0), ("hybrid", 2), ("hybrid", 4), ("ulysses", 0)}
    best, _ = complete(model, {**axes, "micro_batch": 1}, work, cluster)
    chosen = (best.layout.cp_mode, best.layout.cp_ulysses)
    assert priced[chosen] == min(priced.values()) and chosen != ("ring", 0)
    fixed, _ = complete(model, {**axes, "micro_batch": 1, "cp_mode": "ring"}, work, cluster)
    assert (fixed.layout.cp_mode, fixed.layout.cp_ulysses) == ("ring", 0)
    # 8 heads of llama3-70b per tp8 rank: no Ulysses degree 16; hybrids up to 8 only
    assert [c.cp_split()[0] for c in modes(_long_llama("llama3-70b"), Layout(tp=8, cp=16))] == [1, 2, 4, 8]


def test_plan_json_names_the_cp_mode(tmp_path, capsys):
    import json

    from hybridpar.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                               "vocab_size": 128256, "max_position_embeddings": 65536, "rms_norm_eps": 1e-5,
                               "rope_theta": 500000.0, "tie_word_embeddings": False}))
    assert main(["plan", "--model", str(cfg), "--gpus", "16", "--global-batch", "64", "--seq-len", "4096",
                 "--layout", "dp=2,tp=1,pp=1,cp=8", "--json"]) == 0
    layout = json.loads(capsys.readouterr().out)["layout"]
    assert (layout["cp_mode"], layout["cp_ulysses"]) == ("hybrid", 2)
