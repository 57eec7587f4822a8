"""The command line: overrides, errors before launch, and --nproc through torch's launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hybridpar.cli import main

BASE = [
    "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
    "--model.ffn_hidden", "64", "--model.max_seq_len", "64", "--train.seq_len", "32",
    "--train.global_batch", "4", "--train.micro_batch", "2",
    "--train.log_every", "1", "--train.eval_every", "0", "--train.sample_tokens", "8",
]
TINY = [*BASE, "--train.steps", "4"]


def losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_in_process(tmp_path):
    assert main(["train", *TINY, "--train.run_dir", str(tmp_path / "r")]) == 0
    assert len(losses(tmp_path / "r")) == 4


def test_config_file_and_override(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[train]\nsteps = 2\nlog_every = 5\nrun_dir = "{tmp_path / "r"}"\n')
    assert main(["train", "--config", str(cfg), *BASE]) == 0  # BASE overrides log_every to 1
    assert len(losses(tmp_path / "r")) == 2


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--parallel.dp", "2", "--nproc", "3"], "world size 3 != dp * tp * pp * cp = 2 * 1 * 1 * 1 = 2"),
        (["--parallel.tp", "3"], "model.n_kv_heads = 2 < parallel.tp = 3"),
        (["--train.stepz", "1"], "unknown config key train.stepz"),
    ],
)
def test_bad_input_is_one_line_before_launch(tmp_path, capsys, args, needle):
    run = tmp_path / "r"
    assert main(["train", *TINY, "--train.run_dir", str(run), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert not run.exists()  # nothing was started


def test_nproc_with_external_launcher_is_rejected(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["train", *TINY, "--nproc", "1", "--train.run_dir", str(tmp_path / "r")]) == 2
    assert "--nproc cannot be combined with an external torchrun" in capsys.readouterr().err


def test_nproc_launches_data_parallel_that_matches_one_process(tmp_path):
    """`hybridpar train --nproc 2 --parallel.dp 2` through torch.distributed.run: same losses."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, extra in (("one", []), ("two", ["--nproc", "2", "--parallel.dp", "2"])):
        cmd = [sys.executable, "-m", "hybridpar.cli", "train", *TINY, "--train.run_dir", str(tmp_path / name), *extra]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)


def test_resume_flag_continues_bit_for_bit(tmp_path):
    """Delete the final checkpoint of a finished run (as if it died after step 2), then
    `--resume` recreates it exactly."""
    import shutil

    import torch

    from hybridpar.training.checkpoint import load_model_state, step_dir

    run = tmp_path / "r"
    args = ["train", *TINY, "--train.run_dir", str(run), "--train.checkpoint_every", "2"]
    assert main(args) == 0
    _, reference = load_model_state(step_dir(run, 4))
    shutil.rmtree(step_dir(run, 4))
    assert main([*args, "--resume"]) == 0
    _, resumed = load_model_state(step_dir(run, 4))
    for k, v in reference.items():
        assert torch.equal(resumed[k], v), k
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_compare_tells_expected_from_unexpected(tmp_path, capsys):
    """Two runs that differ only in how the global batch is split into micro-batches (2 x 2 vs
    4 x 1) agree to tolerance; a run with another lr does not."""
    def run(name: str, *extra: str) -> str:
        out = str(tmp_path / name)
        assert main(["train", *TINY, "--train.run_dir", out, *extra]) == 0
        return out

    a = run("a", "--train.micro_batch", "2")
    b = run("b", "--train.micro_batch", "1")
    c = run("c", "--train.lr", "1e-2")
    capsys.readouterr()
    assert main(["compare", a, b]) == 0
    out = capsys.readouterr().out
    assert "the runs agree" in out
    assert "config: the same; layout: train.micro_batch 2 -> 1" in out  # which keys differ (issue 44)
    assert main(["compare", a, c]) == 1
    out = capsys.readouterr().out
    assert "NOT expected" in out and "differ by more than layout changes explain" in out
    assert "config: differs in train.lr 0.003 -> 0.01 (these change the result); the same layout" in out
    assert main(["compare", a, str(tmp_path / "missing")]) == 2


def test_train_without_arguments_runs_the_3d_demo(monkeypatch, capsys, tmp_path):
    """`hybridpar train` with no arguments launches dp2 x tp2 x pp2 on 8 local processes; any
    argument means the user's own config (1 process by default)."""
    from hybridpar import cli
    from hybridpar.distributed import launch

    monkeypatch.chdir(tmp_path)  # the demo's run directory (and its lock) is runs/default
    launched: list[tuple[int, list[str]]] = []
    monkeypatch.setattr(launch, "launch_local", lambda nproc, argv, **kw: launched.append((nproc, argv)) or 0)
    monkeypatch.setattr(cli, "_preflight", lambda cfg, nproc, resume: None)
    assert cli.main(["train"]) == 0
    nproc, argv = launched[0]
    assert nproc == 8
    assert argv == ["train", "--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2",
                    "--train.micro_batch", "4"]
    assert "built-in demo" in capsys.readouterr().out


def test_help_lists_each_command_apart_from_its_description(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "calibratemeasure" not in out
    for name in ("train", "calibrate", "timeline"):
        line = next(x for x in out.splitlines() if x.strip().startswith(name + " "))
        assert line.startswith(f"  {name}  "), line  # two spaces at least after the longest name


def test_sample_prompt_is_configurable(tmp_path):
    run = tmp_path / "r"
    assert main(["train", *BASE, "--train.steps", "1", "--train.run_dir", str(run),
                 "--train.sample_prompt", "Once upon"]) == 0
    assert (run / "sample.txt").read_text().startswith("Once upon")


def test_resume_from_a_prepared_dataset_says_it_is_a_dataset(tmp_path, capsys):
    from hybridpar.data.prepare import prepare_dataset

    (tmp_path / "a.txt").write_text("hello world " * 200)
    data = tmp_path / "data"
    prepare_dataset([str(tmp_path / "a.txt")], str(data), tokenizer="bytes", val_fraction=0.1)
    assert main(["train", *TINY, "--train.run_dir", str(tmp_path / "r"), "--resume", str(data)]) == 2
    err = capsys.readouterr().err
    assert f"is a prepared dataset, not a checkpoint; train on it with --train.data {data}" in err
    assert "interrupted while saving" not in err


def test_notices_are_printed_once_under_nproc(tmp_path):
    """Under `--nproc 2` (launcher + two workers) the micro-batch warning and a skipped corrupt
    checkpoint are each printed once (they were printed by the launcher and again by workers)."""
    from test_checkpoint_safety import corrupt

    from hybridpar.training.checkpoint import step_dir

    run = tmp_path / "r"
    args = ["train", *BASE, "--train.run_dir", str(run), "--train.checkpoint_every", "2"]
    assert main([*args, "--train.steps", "4"]) == 0
    corrupt(step_dir(run, 4))
    cmd = [sys.executable, "-m", "hybridpar.cli", *args, "--train.steps", "5", "--nproc", "2", "--parallel.pp", "2",
           "--train.global_batch", "2", "--resume"]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    assert text.count("micro-batches per step < parallel.pp = 2") == 1, text[-3000:]
    assert text.count("skipping checkpoint") == 1, text[-3000:]
