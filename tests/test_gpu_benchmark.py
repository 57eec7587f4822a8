"""``benchmarks/gpu.py`` cannot rot: its CPU quick run works end to end and reports every part."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)  # ~1 minute on 2 idle cores; ~5 on a machine shared by several test runs
def test_gpu_benchmark_cpu_quick_reports_every_part():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--quick"],
                          capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads([line for line in done.stdout.splitlines() if line.startswith('{"benchmark": "gpu"')][-1])
    assert {"device", "torch", "quick", "smoke", "overhead", "cli_mfu", "profile"} <= result.keys()
    assert result["device"] == "cpu" and result["quick"] is True
    smoke = result["smoke"]
    assert {"bf16", "fp16", "moe", "document_mask", "recompute", "zero1_offload", "async_checkpoint_resume",
            "generate"} <= smoke.keys()
    assert all(r["status"] == "ok" for r in smoke.values()), smoke
    eager = result["overhead"]["eager"]
    assert eager["ratio"] > 0 and {"hybridpar", "plain"} <= eager["median_step_ms"].keys()
    assert result["cli_mfu"]["status"] == "ok"
    assert result["cli_mfu"]["mfu"] is None or 0 < result["cli_mfu"]["mfu"] <= 1
    assert result["cli_mfu"]["planned_step_s"] > 0 and result["cli_mfu"]["planned_peak_bytes"] > 0
    profile = result["profile"]
    assert {"host_syncs_per_step", "dtoh_copies_per_step", "optimizer_share", "kernel_ms_per_step",
            "wall_ms_per_step", "kernel_over_wall"} <= profile.keys()
    assert 0 < profile["optimizer_share"] < 1 and profile["wall_ms_per_step"] > 0
    # nothing outside the optimizer reads a value on the host in a step that logs nothing (the CPU
    # stand-in for the GPU's host syncs; the optimizer's CPU step counters are host tensors)
    assert profile["host_syncs_per_step"] == 0
    assert profile["kernel_over_wall"] <= 1.0


@pytest.mark.timeout(900)
def test_gpu_fp8_benchmark_cpu_quick_reports_the_ratios_and_the_plan():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_fp8.py"), "--device", "cpu", "--quick"],
                          capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads([line for line in done.stdout.splitlines() if line.startswith('{"benchmark": "gpu_fp8"')][-1])
    tiny = result["shapes"]["tiny"]
    assert tiny["runs"].keys() == {"ours/none", "ours/tensorwise", "ours/rowwise"}
    assert all(r["step_s"] > 0 and r["planned"]["step_s"] > 0 and r["planned"]["peak_bytes"] > 0
               for r in tiny["runs"].values())
    assert tiny["ratio"].keys() == {"ours/tensorwise", "ours/rowwise"} and all(v > 0 for v in tiny["ratio"].values())


def test_gpu_benchmark_says_when_no_gpu_is_visible():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py")], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)
    assert done.returncode == 2 and "no GPU is visible" in done.stderr
