"""Every real run checks its plan (:mod:`hybridpar.training.plancheck`): ``summary.json``'s
``plan_check`` holds the planner's step time, peak memory per rank and traffic per axis beside
what a real ``hybridpar train`` run measured, with the error of each.

The run: 4 gloo processes (dp2 x pp2), 3 steps, started through a bare interpreter (Linux keeps
the peak resident set across fork and exec: tests/test_planner_fit.py). Traffic must equal the
planner's to the byte on every rank; the peak resident set of every rank must be within the
planner's stated 10%; step time is reported with its error (this shared machine's step time is
noise, and the device model is the uncalibrated CPU core unless a profile was calibrated).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridpar.config import parse_config
from hybridpar.planner.model.layout import from_config
from hybridpar.planner.price.traffic import comm_bytes_per_axis
from hybridpar.training.plancheck import MEMORY_ACCURACY, misses

RUN = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
       "--model.ffn_hidden", "128", "--model.max_seq_len", "64", "--train.seq_len", "64",
       "--train.global_batch", "8", "--train.micro_batch", "2", "--train.steps", "3", "--train.log_every", "1",
       "--train.eval_every", "0", "--train.sample_tokens", "0", "--train.device", "cpu",
       "--parallel.dp", "2", "--parallel.pp", "2"]
METRICS_KEYS = {"step", "world", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_bytes", "step_time_s",
                "skipped", "loss_scale", "val_loss"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run directory, summary.json, the run's output) of the 4-process run."""
    where = tmp_path_factory.mktemp("plancheck") / "run"
    bare = [sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"]
    cmd = [*bare, sys.executable, "-m", "hybridpar.cli", "train", *RUN, "--train.run_dir", str(where)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    return where, json.loads((where / "summary.json").read_text()), out.stdout + out.stderr


def test_summary_holds_the_prediction_and_error_of_each_term(run):
    where, summary, _ = run
    check = summary["plan_check"]
    st = check["step_time_s"]
    assert st["steps_timed"] == 2 and st["predicted"] > 0 and st["measured"] > 0  # steps 2 and 3: after warm-up
    assert st["error"] == pytest.approx(st["predicted"] / st["measured"] - 1)
    mem = check["peak_memory_bytes_per_rank"]
    assert mem["what"] == "peak resident set" and mem["measured"] == summary["peak_memory_bytes_per_rank"]
    assert len(mem["predicted"]) == 4 and mem["predicted"][0] != mem["predicted"][2]  # two pipeline stages
    for p, m, e in zip(mem["predicted"], mem["measured"], mem["error"], strict=True):
        assert e == pytest.approx(p / m - 1) and abs(e) <= MEMORY_ACCURACY
    metrics = [json.loads(line) for line in (where / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1, 2, 3] and all(set(r) <= METRICS_KEYS for r in metrics)


def test_traffic_equals_the_planners_to_the_byte_on_every_rank(run):
    where, summary, out = run
    tr = summary["plan_check"]["traffic_bytes_per_step"]
    layout, work = from_config(parse_config(json.loads((where / "config.json").read_text())))
    cfg = parse_config(json.loads((where / "config.json").read_text()))
    assert tr["predicted"] == comm_bytes_per_axis(cfg.model, layout, work, 0)
    assert set(tr["measured"]) == {"dp", "pp"} and tr["measured"] == tr["predicted"]
    assert tr["error"] == {"dp": 0, "pp": 0} and tr["difference_per_rank"] == [0, 0, 0, 0]
    assert not [m for m in summary["plan_check"]["misses"] if "traffic" in m or "memory" in m]
    assert "plan check: traffic rank 0" in out and "every rank's difference: [0] B" in out


def test_a_miss_is_named_on_one_line_with_its_term():
    """Beyond the stated accuracy: one line per term, naming it (and the axis, the worst rank)."""
    check = {"step_time_s": {"predicted": 0.1, "measured": 0.2, "error": -0.5, "accuracy": 0.3, "calibrated": True,
                             "device_model": "x"},
             "peak_memory_bytes_per_rank": {"what": "peak resident set", "predicted": [100, 120], "measured": [100, 100],
                                            "error": [0.0, 0.2], "accuracy": 0.1},
             "traffic_bytes_per_step": {"error": {"dp": -4, "tp": 0}, "routing_dependent": [],
                                        "difference_per_rank": [4, 0]}}
    lines = misses(check)
    assert len(lines) == 3 and all("\n" not in line for line in lines)
    assert "step time" in lines[0] and "-50.0%" in lines[0] and "not calibrated" not in lines[0]
    assert "peak memory" in lines[1] and "worst rank 1" in lines[1] and "+20.0%" in lines[1]
    assert "traffic" in lines[2] and "dp -4 B" in lines[2] and "tp" not in lines[2]
    check["step_time_s"]["error"] = 0.29  # within 30%: no line
    check["peak_memory_bytes_per_rank"]["error"] = [0.0, 0.1]
    check["traffic_bytes_per_step"] = {"error": {"ep": 96}, "routing_dependent": ["ep"], "difference_per_rank": [0]}
    assert misses(check) == []
