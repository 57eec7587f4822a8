"""What a run reports: a progress bar, ``metrics.jsonl``, TensorBoard events and a loss plot.

Only the rank that owns the logger writes (rank 0); the others get a logger whose methods do
nothing, so the trainer never branches on rank to log.

The bar is drawn only when stderr is a terminal. In a log file or pipe (``make demo | tee``, a
CI job) its redraws, each a carriage return and a line of spaces that clears the bar for the
next message, read as blank lines before the run's first lines (issue 44); there each logged
step prints one plain line instead (:meth:`MetricsLogger.step`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hybridpar.fsutil import (
    atomic_write_text as atomic_write_text,  # re-exported: its users import it here
)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


def _terminal(stream: Any) -> bool:
    """Whether ``stream`` is an interactive terminal (False for files, pipes and closed streams)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class MetricsLogger:
    """Writes one JSON object per logged step, mirrors scalars to TensorBoard, drives tqdm."""

    def __init__(self, run_dir: Path, total_steps: int, enabled: bool, start_step: int = 0) -> None:
        self.enabled = enabled
        self.run_dir = run_dir
        self.history: list[dict[str, Any]] = []
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / METRICS_FILE, "a" if start_step else "w")  # noqa: SIM115 (open for the run)
        self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.total_steps = total_steps
        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                         dynamic_ncols=True, mininterval=1.0, disable=not _terminal(sys.stderr))

    def step(self, record: dict[str, Any] | None) -> None:
        """Advance the bar by one step; log ``record`` if given (it must contain ``step``)."""
        if not self.enabled:
            return
        self._bar.update(1)
        if record is None:
            return
        self.history.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float):
                self._tb.add_scalar(key, value, record["step"])
            elif isinstance(value, list) and value and all(isinstance(v, int | float) for v in value):
                for i, v in enumerate(value):  # e.g. expert_imbalance_per_layer/3
                    self._tb.add_scalar(f"{key}/{i}", v, record["step"])
        post = {"loss": f"{record['loss']:.4f}", "tok/s": f"{record['tokens_per_s']:.0f}",
                "mfu": "n/a" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%", "mem": f"{record['mem_bytes'] / 2**20:.0f}MiB"}
        if "val_loss" in record:
            post["val"] = f"{record['val_loss']:.4f}"
        if self._bar.disable:  # no terminal: one line per logged step instead of the bar
            self.write(f"train: step {record['step']}/{self.total_steps} "
                       + " ".join(f"{k}={v}" for k, v in post.items()))
        else:
            self._bar.set_postfix(post, refresh=False)

    def write(self, message: str) -> None:
        """Print a line without breaking the progress bar (rank 0 only)."""
        if self.enabled:
            tqdm.write(message)

    def close(self) -> None:
        if not self.enabled:
            return
        self._bar.close()
        self._tb.flush()
        self._tb.close()
        self._file.close()

    def plot(self) -> Path | None:
        """Save train (and validation) loss against step as a PNG; returns its path."""
        if not self.enabled or not self.history:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["step"] for r in self.history], [r["loss"] for r in self.history], label="train")
        val = [r for r in self.history if "val_loss" in r]
        if val:
            ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = self.run_dir / PLOT_FILE
        tmp = path.with_name(f".{path.stem}.tmp.png")
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        os.replace(tmp, path)
        return path
