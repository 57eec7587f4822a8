"""The run's progress on a terminal and in a log (issue 44: blank lines at the start of
``make demo``). The bar clears itself for every message with a carriage return and a line of
spaces; in a file or pipe those read as blank lines before the run's first lines, so there the
bar is off and each logged step prints one plain line."""

from __future__ import annotations

from typing import Any

import pytest

from hybridpar.training import metrics
from hybridpar.training.metrics import MetricsLogger


def _record(step: int) -> dict[str, Any]:
    return {"step": step, "loss": 5.5 - step / 10, "tokens_per_s": 1000.0, "mfu": 0.01, "mem_bytes": 2**28}


def _log_two_steps(tmp_path: Any) -> None:
    log = MetricsLogger(tmp_path, total_steps=3, enabled=True)
    log.write("hybridpar: model tiny")
    log.step(_record(1))
    log.step(None)
    log.step(_record(3))
    log.close()


def test_in_a_log_no_bar_redraws_and_one_line_per_logged_step(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    _log_two_steps(tmp_path)  # capsys: stderr is not a terminal
    out, err = capsys.readouterr()
    assert "\r" not in out + err and err == ""
    assert out.splitlines() == ["hybridpar: model tiny",
                                "train: step 1/3 loss=5.4000 tok/s=1000 mfu=1.0% mem=256MiB",
                                "train: step 3/3 loss=5.2000 tok/s=1000 mfu=1.0% mem=256MiB"]


def test_on_a_terminal_the_bar_is_drawn(tmp_path: Any, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "_terminal", lambda stream: True)
    _log_two_steps(tmp_path)
    out, err = capsys.readouterr()
    assert "train: " in err and "3/3" in err  # the bar, on stderr
    assert "train: step" not in out and "hybridpar: model tiny" in out
