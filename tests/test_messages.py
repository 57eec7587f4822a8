"""Messages that read right (issue 44, point 13): each asserts the line a user sees."""

from __future__ import annotations

import json

from hybridpar import cli
from hybridpar.config import config_warnings, load_config
from hybridpar.planner.front.explain import _tflops
from hybridpar.training.loop import RunReport

TINY = ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.ffn_hidden", "64", "--model.max_seq_len", "64", "--train.seq_len", "32",
        "--train.global_batch", "4", "--train.micro_batch", "2", "--train.steps", "1",
        "--train.eval_every", "0"]


def test_cp_mode_without_context_parallelism_is_named_not_silent():
    cfg = load_config(None, ["--parallel.cp_mode", "ulysses"])
    assert "parallel.cp_mode = 'ulysses' has no effect with parallel.cp = 1; ignored" in config_warnings(cfg)
    assert not [w for w in config_warnings(load_config(None, [])) if "cp_mode" in w]


def test_sample_tokens_zero_prints_no_sample_block(tmp_path, capsys):
    run = tmp_path / "r"
    assert cli.main(["train", *TINY, "--train.sample_tokens", "0", "--train.run_dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "--- sample ---" not in out and "sample.txt" not in out and not (run / "sample.txt").exists()
    assert json.loads((run / "summary.json").read_text())["steps"] == 1


def test_traffic_line_leaves_out_axes_that_sent_nothing_and_shows_small_amounts(tmp_path):
    report = RunReport(tmp_path, True, "dp2", 2, "cpu", "1f1b")
    line = report.details({"dp": 0, "dp_shard": 3 * 2**20 // 2, "dp_rep": 2048}, [2**20, 2**20], None).splitlines()[1]
    assert line == "traffic per step (rank 0, ring-model bytes sent): dp_shard 1.50 MiB, dp_rep 2.0 KiB"


def test_a_cpus_tflops_are_not_shown_as_zero():
    assert _tflops(0.0213) == "0.0213" and _tflops(412.34) == "412.3" and _tflops(37.14) == "37.1"
