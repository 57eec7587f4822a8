"""Old spellings of settings that moved to a feature's own section (``train.fp8`` ->
``fp8.recipe``, ...): a TOML file, a ``--section.key`` override and an old run's ``config.json``
are read as the new keys, with one line naming each new key. Pure logic, no process group."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hybridpar.config import RENAMED, SECTIONS, Config, ConfigError, config_from_dict, load_config
from hybridpar.config import renamed as renamed_module
from hybridpar.training.checkpoint import read_config

ZERO3 = ["--parallel.dp", "2", "--parallel.zero_stage", "3"]


@pytest.fixture(autouse=True)
def _fresh_notes(monkeypatch):
    """Each test sees the notes as a new process would (each old key named once per process)."""
    monkeypatch.setattr(renamed_module, "_said", set())
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv(renamed_module.SAID_ENV, "")  # restored afterwards


def _notes(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if "is now" in line]


def test_every_old_key_is_gone_from_its_section_and_the_new_one_exists():
    for old, new in RENAMED.items():
        (old_section, old_name), (new_section, new_name) = old.split("."), new.split(".")
        assert old_name not in {f.name for f in dataclasses.fields(SECTIONS[old_section])}, old
        assert new_name in {f.name for f in dataclasses.fields(SECTIONS[new_section])}, new


def test_old_keys_on_the_command_line_name_the_new_key_once(capsys, monkeypatch):
    old = load_config(None, ["--train.fp8", "tensorwise", "--parallel.fp8_all_gather", "true",
                             "--train.async_checkpoint", "true", *ZERO3])
    assert _notes(capsys) == [f"hybridpar: note: {k} is now {v} (the old spelling is read as the new one)"
                              for k, v in RENAMED.items()]
    new = load_config(None, ["--fp8.recipe", "tensorwise", "--fp8.all_gather", "true",
                             "--async_checkpoint.enabled", "true", *ZERO3])
    assert old == new and new.fp8.recipe == "tensorwise" and new.fp8.all_gather and new.async_checkpoint.enabled
    load_config(None, ["--train.fp8", "rowwise"])
    assert _notes(capsys) == []  # said once per process
    monkeypatch.setattr(renamed_module, "_said", set())  # a rank the launcher started: told already
    monkeypatch.setenv("RANK", "0")
    load_config(None, ["--train.fp8", "rowwise"])
    assert _notes(capsys) == []


def test_old_keys_in_a_toml_file_are_read(tmp_path, capsys):
    path = tmp_path / "old.toml"
    path.write_text('[parallel]\ndp = 2\nzero_stage = 3\nfp8_all_gather = true\n'
                    '[train]\nfp8 = "tensorwise"\nasync_checkpoint = true\n')
    cfg = load_config(path)
    assert (cfg.fp8.recipe, cfg.fp8.all_gather, cfg.async_checkpoint.enabled) == ("tensorwise", True, True)
    assert len(_notes(capsys)) == 3


def test_an_old_runs_config_json_loads(tmp_path, capsys):
    """A checkpoint's config.json written before the move (no [fp8] / [async_checkpoint])."""
    data = Config().to_dict()
    del data["fp8"], data["async_checkpoint"]
    data["train"].update(fp8="rowwise", async_checkpoint=True)
    data["parallel"]["fp8_all_gather"] = False
    (tmp_path / "config.json").write_text(json.dumps(data))
    cfg = read_config(tmp_path)
    assert cfg.fp8.recipe == "rowwise" and cfg.async_checkpoint.enabled
    assert cfg == config_from_dict(Config().to_dict() | {"fp8": {"recipe": "rowwise"},
                                                         "async_checkpoint": {"enabled": True}})
    assert "train.fp8 is now fp8.recipe" in capsys.readouterr().err


def test_old_and_new_spelling_together_is_refused(tmp_path):
    path = tmp_path / "both.toml"
    path.write_text('[train]\nfp8 = "rowwise"\n[fp8]\nrecipe = "tensorwise"\n')
    with pytest.raises(ConfigError, match=r"train.fp8 and fp8.recipe both set in .*keep only fp8.recipe"):
        load_config(path)


def test_errors_name_the_new_key():
    with pytest.raises(ConfigError, match=r"fp8.recipe = 'mxfp8' is not an FP8 recipe"):
        load_config(None, ["--train.fp8", "mxfp8"])
