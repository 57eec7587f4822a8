"""Learning from runs (``hybridpar plan --from-run``, ``hybridpar calibrate --from-run``;
:mod:`hybridpar.planner.front.fit`) and the allocator model of a CPU rank's resident set
(:mod:`hybridpar.planner.machine.allocator`), against a real ``hybridpar train`` run of this machine.

What is fitted: multipliers of each kernel class's time (GEMM, attention, memory-bound, launches;
one shared multiplier for one run), through the full cost model. The same-run check below goes
through the written profile and ``plan --gpu`` (the fitted terms must survive the round trip and
price the run's layout within the issue's 5%); the held-out check (fit on one run, predict
another layout) is ``benchmarks/planner_validation.py --from-run``. The least-squares machinery
is checked on synthetic runs whose true multipliers are known.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from hybridpar.cli import main
from hybridpar.planner.front.fit import (
    RunRecord,
    fit_runs,
    predict,
    predicted_peak,
    read_run,
    with_fit,
)
from hybridpar.planner.machine.efficiency import efficiency_of
from hybridpar.planner.machine.hardware import gpu_spec, load_gpu_toml
from hybridpar.planner.model.layout import Layout

RUN = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
       "--model.ffn_hidden", "128", "--model.max_seq_len", "64", "--train.seq_len", "64",
       "--train.global_batch", "4", "--train.micro_batch", "2", "--train.steps", "6", "--train.log_every", "1",
       "--train.eval_every", "0", "--train.sample_tokens", "4", "--train.device", "cpu"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One real CPU run in a process of its own, started through a bare interpreter: Linux keeps
    ``ru_maxrss`` (the runtime's CPU peak) across fork and exec, so a run forked straight from
    this test process would report this process's resident set when that is larger; forked from
    a process that imports nothing, it starts from that one's few MiB."""
    run = tmp_path_factory.mktemp("fit") / "run"
    bare = [sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"]
    cmd = [*bare, sys.executable, "-m", "hybridpar.cli", "train", *RUN, "--train.run_dir", str(run)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    return run


def test_from_run_profile_predicts_the_run(run_dir, tmp_path, capsys):
    """``calibrate --from-run`` writes a profile whose fitted multipliers, read back by
    ``plan --gpu``, price the run's own layout within 5% of its median measured step time; the
    fit scales compute classes only (communication and the layout's terms keep their form)."""
    run = read_run(run_dir)
    assert run.layout == Layout(micro_batch=2) and run.steps_timed == 5 and run.device == "cpu"
    profile = tmp_path / "fitted.toml"
    assert main(["calibrate", "--from-run", str(run_dir), "--out", str(profile)]) == 0
    gpu = load_gpu_toml(profile)
    fit = efficiency_of(gpu).fit
    assert len(set(fit)) == 1 and fit[0] != 1.0  # one run: one multiplier shared by the classes
    assert predict(run, gpu) == pytest.approx(run.step_time_s, rel=0.05)
    capsys.readouterr()
    assert main(["plan", "--from-run", str(run_dir), "--gpu", str(profile), "--json",
                 "--layout", "dp=1,tp=1,pp=1,cp=1,micro_batch=2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    row = doc["from_run"]["runs"][0]
    assert abs(row["error_after"]) <= 0.05 and row["measured_step_s"] == pytest.approx(run.step_time_s)
    assert row["moved"] == pytest.approx(row["predicted_after_s"] / row["predicted_before_s"] - 1)
    assert doc["layout"]["micro_batch"] == 2 and doc["gpus"] == 1 and doc["seq_len"] == 64


def test_cpu_resident_set_model(run_dir):
    """The planner's resident-set model of a CPU rank (baseline + live tensors + backward and
    optimizer transients) against the run's measured peak resident set, within 10%."""
    run = read_run(run_dir)
    assert predicted_peak(run) == pytest.approx(max(run.peak_memory), rel=0.10)


def _synthetic(model_runs: list[tuple[Layout, int]], truth) -> list[RunRecord]:
    """Runs whose measured step time is what the planner predicts on ``truth``."""
    from hybridpar.config import model_preset
    from hybridpar.planner.model.layout import Workload

    out = []
    for layout, batch in model_runs:
        work = Workload(batch, 256, "bf16", half_params=False)
        rec = RunRecord(None, model_preset("tiny"), layout, work, layout.world_size, "cuda", 0.0, 1, (), "")  # type: ignore[arg-type]
        out.append(dataclasses.replace(rec, step_time_s=predict(rec, truth)))
    return out


def test_two_runs_fit_two_multipliers_and_predict_a_third():
    """Two runs fit (arithmetic, memory-bound + launch) multipliers by least squares; runs made
    on a device with known multipliers are reproduced, and so is a third, held-out layout."""
    base = gpu_spec("H100-SXM")
    truth = with_fit(base, (1.6, 1.6, 0.7, 0.7))
    runs = _synthetic([(Layout(micro_batch=1), 8), (Layout(micro_batch=8), 64)], truth)
    fitted = fit_runs(runs, base)
    assert efficiency_of(fitted).fit == pytest.approx((1.6, 1.6, 0.7, 0.7), rel=1e-3)
    (held_out,) = _synthetic([(Layout(micro_batch=4), 16)], truth)
    assert predict(held_out, fitted) == pytest.approx(held_out.step_time_s, rel=1e-3)
    assert predict(held_out, base) != pytest.approx(held_out.step_time_s, rel=0.05)  # the fit did the work


def test_fitted_profile_keeps_a_calibrated_base(tmp_path):
    """A fitted profile written over a calibrated base keeps the base's measured tables and
    replaces only its [efficiency] table; a bad [efficiency] value is one clear error."""
    from hybridpar.planner.front.fit import FittedRuns, write_profile
    from hybridpar.planner.machine.hardware import PlanError

    base_file = tmp_path / "base.toml"
    base_file.write_text('[gpu]\nbase = "A100-80GB"\n\n[calibration]\ngemm = [[64, 64, 64, 1e12]]\n\n'
                         '[efficiency]\nfit = [2.0, 2.0, 2.0, 2.0]\n')
    base = load_gpu_toml(base_file)
    fitted = with_fit(base, (3.0, 3.0, 1.5, 1.5))
    out = write_profile(FittedRuns([], base, "test", fitted, "m", base_file), tmp_path / "fitted.toml")
    back = load_gpu_toml(out)
    assert back.calibration == base.calibration and efficiency_of(back).fit == (3.0, 3.0, 1.5, 1.5)
    bad = tmp_path / "bad.toml"
    bad.write_text('[gpu]\nbase = "A100-80GB"\n\n[efficiency]\nfit = [1.0, -1.0, 1.0, 1.0]\n')
    with pytest.raises(PlanError, match="efficiency.fit"):
        load_gpu_toml(bad)
