"""train.compile: regional compilation composes with every parallelism and trains what eager trains.

Two backends, two questions:

* ``aot_eager`` (dynamo + AOT autograd, eager kernels) across layouts: does compiling the blocks
  compose with tp/SP, cp, every pipeline schedule (the zero-bubble W split included), ZeRO-1/2/3,
  recomputation, expert parallelism? Graph breaks at collectives, module hooks around compiled
  forwards, recomputation rerunning them. Compared with the eager single-process run to the
  invariance matrix's tolerances (``test_layouts.py``), which allow for the layouts' own
  reordering of reductions.
* ``inductor`` (generated C++ kernels): fused elementwise chains (RMSNorm, rotary, SwiGLU) may
  round differently from eager's op-by-op kernels, by units of float32 roundoff per fused op:
  the same class of difference as a layout's reduction order, so the same tolerances hold
  (losses to 1e-5 relative; weights to 1% of lr x steps absolute, because Adam can turn a
  rounding-level gradient difference into up to its whole step lr in an entry whose gradient is
  noise). The generated kernels are checked at every vector width the CPU has (inductor's own
  ``cpp.simdlen``; not through ATEN_CPU_CAPABILITY, under whose ``default`` torch 2.13's
  inductor cannot build its code).
"""

from __future__ import annotations

import pytest
import test_moe_layouts as moe
import torch
from test_layouts import LAYOUTS, WEIGHT_ATOL, config, reference
from test_trainer import SMALL

from hybridpar.compat import compile_stats
from hybridpar.config import ConfigError, load_config
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.parallel.pipeline.runtime import PipelineRunner
from hybridpar.training.trainer import Trainer

AOT = ["--train.compile", "true", "--train.compile_backend", "aot_eager"]
INDUCTOR = ["--train.compile", "true"]
STEPS = 3

COMPOSED = {
    name: LAYOUTS[name] for name in [
        "dp2-zero3-recompute-full",  # ZeRO-3's unit hooks around compiled forwards, recomputed
        "dp2-tp2-sp-recompute-full",  # SP gathers / reduce-scatters: graph breaks
        "cp2-recompute-selective",  # ring attention inside a compiled block, its core recomputed
        "dp2-tp2-pp2-cp2-recompute-full",
        "dp2-pp2-interleaved-zero3",  # ZeRO-3 x pp
        "dp2-pp2-zb-zero2",  # the W split: each linear eager, the code between compiled
        "pp2-zbv",
        "dp2-tp2-pp2-cp2-zb",
    ]
}


def _run(rank: int, world: int, tmp: str, layout: list[str], mixtral: bool = False) -> dict:
    cfg = moe.config(tmp, layout) if mixtral else config(tmp, layout)
    with ParallelDims.from_config(cfg.parallel).build("cpu") as topo:
        trainer = Trainer(cfg, topo)
        results = [trainer.train_step(s) for s in range(1, STEPS + 1)]
        runner = trainer.engine.last_pipeline_step
        state = trainer.engine.full_state_dict()  # collective (ZeRO-3, pp)
        return {"losses": [r.loss for r in results], "state": state if rank == 0 else None,
                "compiled": trainer.engine.compiled, "stats": compile_stats(),
                "deferred": 0 if runner is None else runner.peak_deferred_bytes,
                # every pair of this rank runs B and W fused (ZB-H1's first stage): nothing deferred
                "all_fused": _all_fused(trainer.engine.runner)}


def _all_fused(runner: PipelineRunner | None) -> bool:
    return runner is not None and len(runner.fused) == runner.schedule.microbatches * runner.schedule.virtual_stages


def _check(results: list[dict], ref: dict) -> None:
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5), f"rank {rank}"
    for k, v in results[0]["state"].items():
        torch.testing.assert_close(v, ref["state"][k], rtol=0, atol=WEIGHT_ATOL, msg=lambda m, k=k: f"{k}: {m}")


def _compiled(results: list[dict], blocks: int) -> None:
    for r in results:
        assert r["compiled"] == blocks and r["stats"].graphs >= 1


@pytest.mark.parametrize("name", list(COMPOSED))
def test_compiled_layout_matches_eager_single_process(name, dist_run, tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "layouts")  # test_layouts' eager reference, shared
    layout = [*COMPOSED[name], *AOT]
    results = dist_run(config(tmp, layout).parallel.world_size, _run, tmp, layout)
    _check(results, reference(tmp))
    _compiled(results, 8)
    if "zb" in name:  # the W split still defers the linears' weight gradients where it splits
        assert all((r["deferred"] > 0) != r["all_fused"] for r in results)
        assert any(r["deferred"] > 0 for r in results)


def test_compiled_two_bw_matches_eager_two_bw(dist_run, tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "compile-2bw")
    layout = ["--parallel.pp", "2", "--parallel.pipeline_schedule", "2bw"]
    eager = dist_run(2, _run, tmp, layout)
    compiled = dist_run(2, _run, tmp, [*layout, *AOT])
    _check(compiled, eager[0])
    _compiled(compiled, 8)


def test_compiled_expert_parallel_matches_single_process(dist_run, tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "compile-moe")
    ref = _run(0, 1, tmp, [], True)
    layout = [*moe.LAYOUTS["ep2"], *AOT]
    results = dist_run(2, _run, tmp, layout, True)
    _check(results, ref)
    _compiled(results, 4)


def _vector_widths() -> list[int]:
    """The vector widths (bits) inductor can generate C++ for on this CPU, e.g. [256, 512]."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    return sorted({isa.bit_width() for isa in valid_vec_isa_list()})


def test_inductor_matches_eager_at_every_vector_width(tmp_path_factory):
    """Inductor's generated kernels at each vector width this CPU has (AVX2 and AVX-512 here),
    chosen with inductor's own setting: under ATEN_CPU_CAPABILITY=default torch 2.13's inductor
    emits vector code it cannot compile (rule train-compile-inductor), so these widths are
    swept here instead of by the Makefile's numerics passes."""
    tmp = str(tmp_path_factory.getbasetemp() / "layouts")
    ref = reference(tmp)
    widths = _vector_widths()
    assert widths, "inductor finds no vector ISA on this CPU"
    for width in widths:
        with torch._inductor.config.patch({"cpp.simdlen": width}):
            result = _run(0, 1, tmp, INDUCTOR)
        _check([result], ref)
        _compiled([result], 8)
        assert result["stats"].seconds > 0


def test_inductor_tensor_parallel_matches_eager(dist_run, tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "layouts")
    layout = [*LAYOUTS["dp2-tp2-sp"], *INDUCTOR]
    results = dist_run(4, _run, tmp, layout)
    _check(results, reference(tmp))
    _compiled(results, 8)


def test_the_run_reports_compile_time(tmp_path, capsys):
    cfg = load_config(None, [*SMALL, "--train.run_dir", str(tmp_path / "run"), "--train.steps", "2", *AOT])
    with ParallelDims.from_config(cfg.parallel).build("cpu") as topo:
        summary = Trainer(cfg, topo).fit()
    assert summary["compile_s"] > 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("compiled "))
    assert line.startswith("compiled 2 blocks (aot_eager): ") and "s compiling in the first step" in line


def test_inductor_without_a_cxx_compiler_is_refused(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match="train.compile = true with train.compile_backend = 'inductor' needs a C"):
        load_config(None, INDUCTOR)
    load_config(None, AOT)  # aot_eager builds nothing


def test_inductor_with_default_cpu_capability_is_refused(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    with pytest.raises(ConfigError, match="cannot build CPU kernels while ATEN_CPU_CAPABILITY=default"):
        load_config(None, INDUCTOR)
    load_config(None, AOT)
    load_config(None, [*INDUCTOR, "--train.device", "cuda"])  # Triton kernels: not affected
