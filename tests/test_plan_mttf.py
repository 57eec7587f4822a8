"""``hybridpar plan --mttf``: Young/Daly's intervals and goodput, against the formulas by hand."""

from __future__ import annotations

import json
import math

import pytest

from hybridpar.planner.front.cli import cmd_plan
from hybridpar.planner.front.resilience import parse_duration, useful_share, young_daly
from hybridpar.planner.machine.hardware import PlanError


def test_durations_and_the_young_daly_interval():
    assert parse_duration("3h", "--mttf") == 10800 and parse_duration("20m", "--mttf") == 1200
    assert parse_duration("90", "--mttf") == 90 and parse_duration("1.5d", "--mttf") == 129600
    with pytest.raises(PlanError, match=r"--mttf '3 hours' must be a positive duration such as 3h"):
        parse_duration("3 hours", "--mttf")
    assert young_daly(10.0, 3600.0) == pytest.approx(math.sqrt(2 * 10 * 3600) - 10)
    assert young_daly(0.0, 3600.0) == 0.0
    # the useful share is largest at Young/Daly's interval (first order)
    best = young_daly(10.0, 3600.0)
    share = useful_share(best, 10.0, 60.0, 3600.0)
    assert share == pytest.approx(best / (best + 10) * (1 - (60 + (best + 10) / 2) / 3600))
    assert share > useful_share(best / 2, 10.0, 60.0, 3600.0) and share > useful_share(2 * best, 10.0, 60.0, 3600.0)


def test_plan_mttf_prices_snapshots_and_disk_checkpoints_of_the_best_layout(capsys):
    argv = ["--model", "llama3-8b", "--gpus", "64", "--global-batch", "128", "--seq-len", "4096",
            "--mttf", "3h", "--top", "1", "--json"]
    assert cmd_plan(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    r = doc["resilience"]
    assert r["mttf_s"] == pytest.approx(10800.0 * 16384 / 64)  # measured at 16384 GPUs, planned at 64
    step, state = r["step_time_s"], r["state_bytes_per_gpu"]
    assert step == pytest.approx(doc["layouts"][0]["step_time_s"])
    gib = doc["layouts"][0]["memory_gib"]
    assert state / 2**30 == pytest.approx(gib["params"] + gib["optimizer"], abs=0.01)
    mttf, disk = r["mttf_s"], r["disk_only"]
    from hybridpar.planner.machine.hardware import gpu_spec

    gpu = gpu_spec("H100-SXM")
    assert disk["save_stall_s"] == pytest.approx(state / gpu.disk_bw)
    assert disk["every_steps"] == max(1, round(young_daly(state / gpu.disk_bw, mttf) / step))
    assert disk["goodput"] == pytest.approx(useful_share(disk["every_steps"] * step, disk["save_stall_s"],
                                                         60 + state / gpu.disk_bw, mttf))
    snap = r["snapshot"]
    copy = state / gpu.host_bw + state / gpu.inter_bw  # to host memory, and the replica to the next node
    assert snap["save_stall_s"] == pytest.approx(max(0.0, copy - step))
    assert snap["every_steps"] == max(1, round(max(step, young_daly(snap["save_stall_s"], mttf)) / step))
    assert snap["goodput"] > disk["goodput"]
    assert cmd_plan(argv[:-1]) == 0
    assert f"failures: one every {mttf / 3600:.2f} h on 64 GPUs" in capsys.readouterr().out
