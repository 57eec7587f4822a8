"""docs/reference/errors.md's config/launcher table is the truth: every row is refused with its message."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from hybridpar.cli import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "reference" / "errors.md"


def rows() -> list[tuple[str, str]]:
    text = DOC.read_text()
    table = text.split("## Config and launcher", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            out.append((cells[0].strip("`"), cells[1]))
    return out


def test_the_table_is_not_empty():
    assert len(rows()) >= 30


@pytest.mark.parametrize("args, message", rows())
def test_documented_message(args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths in the table resolve to nothing here
    assert main(["train", "--train.run_dir", str(tmp_path / "run"), *shlex.split(args)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert message in err, err
    assert not (tmp_path / "run").exists()
