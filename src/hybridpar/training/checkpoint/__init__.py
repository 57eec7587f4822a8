"""Checkpoints (being split into a package; see paths.py)."""

from hybridpar.training.checkpoint.paths import *  # noqa: F403
