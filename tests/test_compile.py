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

import layouts
import pytest
import torch
from layouts import Run, Trained, assert_trains_like, reference, train, train_layout
from test_layouts import LAYOUTS, MODEL, WEIGHT_ATOL
from test_moe_layouts import LAYOUTS as MOE_LAYOUTS
from test_moe_layouts import MOE

from hybridpar.compat import compile_stats
from hybridpar.config import ConfigError, load_config
from hybridpar.parallel.pipeline.runtime import PipelineRunner
from hybridpar.training.features.compile import CompileComponent
from hybridpar.training.trainer import Trainer

AOT = ["--train.compile", "true", "--train.compile_backend", "aot_eager"]
INDUCTOR = ["--train.compile", "true"]
STEPS = 3

COMPOSED = {
    **{name: LAYOUTS[name] for name in [
        "dp2-zero3-recompute-full",  # ZeRO-3's unit hooks around compiled forwards, recomputed
        "dp2-tp2-sp-recompute-full",  # SP gathers / reduce-scatters: graph breaks
        "cp2-recompute-selective",  # ring attention inside a compiled block, its core recomputed
        "dp2-pp2-interleaved-zero3",  # ZeRO-3 x pp
        "dp2-pp2-zb-zero2",  # the W split: each linear eager, the code between compiled
        "pp2-zbv",
    ]},
    # every in-block axis at once (tp's and SP's collectives, cp's ring, pp's stage boundaries),
    # recomputed and under the W split, on 8 ranks: dp sits outside the compiled blocks (its
    # reduction runs after backward) and is composed with compile above; the 16-rank
    # dp2-tp2-pp2-cp2 layouts are test_layouts.py's, eager
    "pp2-cp2-tp2-sp-recompute-full": [*LAYOUTS["pp2-cp2-tp2-sp"], "--parallel.recompute", "full"],
    "pp2-cp2-tp2-zb": [*LAYOUTS["pp2-cp2"], "--parallel.tp", "2", "--parallel.pipeline_schedule", "zb-h1"],
}


def _report(trainer: Trainer) -> dict:
    """What compiling did on this rank (after training and gathering the weights)."""
    runner = trainer.engine.last_pipeline_step
    compiled = trainer.hooks.find(CompileComponent)  # None: an eager run
    return {"compiled": compiled.blocks if compiled is not None else 0, "stats": compile_stats(),
            "deferred": 0 if runner is None else runner.peak_deferred_bytes,
            # every pair of this rank runs B and W fused (ZB-H1's first stage): nothing deferred
            "all_fused": _all_fused(trainer.engine.runner)}


def _run(tmp: str, flags: list[str] | tuple[str, ...]) -> Run:
    return Run(tmp, flags, STEPS, after=_report)


def _all_fused(runner: PipelineRunner | None) -> bool:
    return runner is not None and len(runner.fused) == runner.schedule.microbatches * runner.schedule.virtual_stages


def _compiled(results: list[Trained], blocks: int) -> None:
    for r in results:
        assert r.extra["compiled"] == blocks and r.extra["stats"].graphs >= 1


@pytest.mark.parametrize("name", list(COMPOSED))
def test_compiled_layout_matches_eager_single_process(name, tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "layouts")  # test_layouts' eager reference, shared
    results = train_layout(_run(tmp, (*MODEL, *COMPOSED[name], *AOT)))
    assert_trains_like(results, reference(Run(tmp, MODEL)), atol=WEIGHT_ATOL)
    _compiled(results, 8)
    if "zb" in name:  # the W split still defers the linears' weight gradients where it splits
        assert all((r.extra["deferred"] > 0) != r.extra["all_fused"] for r in results)
        assert any(r.extra["deferred"] > 0 for r in results)


def test_compiled_two_bw_matches_eager_two_bw(tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "compile-2bw")
    layout = (*MODEL, "--parallel.pp", "2", "--parallel.pipeline_schedule", "2bw")
    eager = train_layout(_run(tmp, layout))
    compiled = train_layout(_run(tmp, (*layout, *AOT)))
    assert_trains_like(compiled, eager[0], atol=WEIGHT_ATOL)
    _compiled(compiled, 8)


def test_compiled_expert_parallel_matches_single_process(tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "compile-moe")
    ref = reference(Run(tmp, MOE))
    results = train_layout(_run(tmp, (*MOE, *MOE_LAYOUTS["ep2"], *AOT)))
    assert_trains_like(results, ref, atol=WEIGHT_ATOL)
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
    ref = reference(Run(tmp, MODEL))
    widths = _vector_widths()
    assert widths, "inductor finds no vector ISA on this CPU"
    for width in widths:
        with torch._inductor.config.patch({"cpp.simdlen": width}):
            result = train(0, 1, _run(tmp, (*MODEL, *INDUCTOR)))
        assert_trains_like([result], ref, atol=WEIGHT_ATOL)
        _compiled([result], 8)
        assert result.extra["stats"].seconds > 0


def test_inductor_tensor_parallel_matches_eager(tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "layouts")
    results = train_layout(_run(tmp, (*MODEL, *LAYOUTS["dp2-tp2-sp"], *INDUCTOR)))
    assert_trains_like(results, reference(Run(tmp, MODEL)), atol=WEIGHT_ATOL)
    _compiled(results, 8)


def test_the_run_reports_compile_time(tmp_path, capsys):
    cfg = layouts.make_config(str(tmp_path / "run"), "--train.steps", "2", *AOT, lr=None)
    with layouts.trainer_for(cfg) as trainer:
        summary = trainer.fit()
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
