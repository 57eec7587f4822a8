"""Checkpoints: atomic, exact resume, safe loading, layout-independent model state."""

from __future__ import annotations

import pickle

import pytest
import torch
from layouts import SMALL, make_trainer, trainer_for

from hybridpar.cli import main
from hybridpar.config import load_config
from hybridpar.training import checkpoint
from hybridpar.training.trainer import Trainer


def make(tmp_path, name: str, *extra: str) -> Trainer:
    cfg = load_config(None, [*SMALL, "--train.run_dir", str(tmp_path / name), "--train.steps", "20",
                             "--train.checkpoint_every", "10", "--train.eval_every", "0",
                             "--train.log_every", "1", *extra])
    return make_trainer(cfg)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def losses(run) -> dict[int, float]:
    import json

    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_interrupted_run_resumes_bit_for_bit(tmp_path, monkeypatch):
    full = make(tmp_path, "full")
    full.fit()
    ref = weights(full)

    crashing = make(tmp_path, "crash")
    real_step = Trainer.train_step

    def step_until_13(self, step):
        if step == 13:
            raise KeyboardInterrupt("simulated crash")
        return real_step(self, step)

    monkeypatch.setattr(Trainer, "train_step", step_until_13)
    with pytest.raises(KeyboardInterrupt):
        crashing.fit()
    monkeypatch.setattr(Trainer, "train_step", real_step)
    run = tmp_path / "crash"
    assert max(losses(run)) == 12  # logged past the checkpoint before the crash
    latest = checkpoint.latest_checkpoint(run)
    assert latest is not None and latest.name == "step-000010"

    resumed = make(tmp_path, "crash")
    resumed.fit(resume=checkpoint.resolve_resume("latest", run))
    for k, v in weights(resumed).items():
        assert torch.equal(v, ref[k]), k
    assert losses(run) == losses(tmp_path / "full")  # steps 11-12 re-logged once, not twice
    state = resumed.optimizer.state_dict()["state"]
    ref_state = full.optimizer.state_dict()["state"]
    for i, s in state.items():
        assert torch.equal(s["exp_avg_sq"], ref_state[i]["exp_avg_sq"])


def test_incomplete_checkpoints_are_ignored_and_rejected(tmp_path):
    trainer = make(tmp_path, "r", "--train.steps", "10")
    trainer.fit()
    run = tmp_path / "r"
    good = checkpoint.latest_checkpoint(run)
    broken = run / "checkpoints" / "step-000020"
    broken.mkdir()
    (broken / ".metadata").write_bytes(b"partial")
    assert checkpoint.latest_checkpoint(run) == good
    with pytest.raises(checkpoint.CheckpointError, match="incomplete"):
        checkpoint.resolve_resume(str(broken), run)
    with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint"):
        checkpoint.resolve_resume("latest", tmp_path / "elsewhere")
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_resume_into_another_model_shape_names_the_field(tmp_path):
    make(tmp_path, "r", "--train.steps", "10").fit()
    other = make(tmp_path, "r", "--model.ffn_hidden", "96")
    with pytest.raises(checkpoint.CheckpointError, match="model.ffn_hidden: checkpoint 64 vs run 96"):
        other.fit(resume=checkpoint.latest_checkpoint(tmp_path / "r"))


class _Exploit:
    def __reduce__(self):
        return (print, ("pwned",))


def test_metadata_with_foreign_globals_is_refused(tmp_path, capsys):
    make(tmp_path, "r", "--train.steps", "10").fit()
    ckpt = checkpoint.latest_checkpoint(tmp_path / "r")
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(checkpoint.CheckpointError, match="not allowed"):
        checkpoint.load_model_state(ckpt)
    assert "pwned" not in capsys.readouterr().out


def test_load_model_state_returns_the_trained_weights(tmp_path):
    trainer = make(tmp_path, "r", "--train.steps", "10")
    trainer.fit()
    cfg, state = checkpoint.load_model_state(checkpoint.latest_checkpoint(tmp_path / "r"))
    assert cfg.model == trainer.cfg.model
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(state[k], v), k


def test_cli_resume_errors_before_launch(tmp_path, capsys):
    args = ["train", *SMALL, "--train.run_dir", str(tmp_path / "none"), "--resume"]
    assert main(args) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


def _dp_run(rank: int, world: int, tmp: str) -> None:
    cfg = load_config(None, [*SMALL, "--train.run_dir", tmp, "--parallel.dp", str(world), "--train.steps", "6",
                             "--train.checkpoint_every", "4", "--train.eval_every", "0"])
    with trainer_for(cfg) as trainer:
        trainer.fit()


def test_data_parallel_checkpoint_resumes_in_one_process(tmp_path, dist_run):
    """Saved at step 4 by dp=2, continued to step 6 by dp=1: equal to dp=1 all along."""
    dist_run(2, _dp_run, str(tmp_path / "dp2"))
    cont = make(tmp_path, "cont", "--train.steps", "6", "--train.checkpoint_every", "0")
    cont.fit(resume=checkpoint.step_dir(tmp_path / "dp2", 4))
    ref = make(tmp_path, "ref", "--train.steps", "6", "--train.checkpoint_every", "0")
    ref.fit()
    for k, v in ref.model.state_dict().items():
        torch.testing.assert_close(cont.model.state_dict()[k], v, rtol=1e-5, atol=1e-6)


def test_generate_from_checkpoint_matches_the_trained_model(tmp_path, capsys):
    trainer = make(tmp_path, "r", "--train.steps", "10")
    trainer.fit()
    ckpt = checkpoint.latest_checkpoint(tmp_path / "r")
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "import ", "--tokens", "20",
                 "--temperature", "0"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    from hybridpar.training.generate import sample

    tokens = sample(trainer.model, list(b"import "), 20, trainer.cfg.model.max_seq_len, temperature=0)
    assert printed == trainer.tokenizer.decode(tokens)
    assert main(["generate", "--checkpoint", str(tmp_path / "nope")]) == 2


def test_truncated_shard_is_a_clear_error(tmp_path):
    make(tmp_path, "r", "--train.steps", "10").fit()
    ckpt = checkpoint.latest_checkpoint(tmp_path / "r")
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(checkpoint.CheckpointError, match="does not match its checksum"):
        checkpoint.load_model_state(ckpt)
    other = make(tmp_path, "r2", "--train.steps", "12")
    with pytest.raises(checkpoint.CheckpointError, match=f"{shard.name} does not match its checksum"):
        other.load_checkpoint(ckpt)
