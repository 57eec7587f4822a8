"""``hybridpar compare RUN_A RUN_B``: is the difference between two runs expected?

Two runs of the same config under different layouts should agree to floating-point tolerance:
losses to about 1e-5 relative in fp32 (only the order of summations differs), weights to a
small multiple of ``lr`` per step (Adam divides by sqrt(v), so an entry whose gradient is pure
rounding noise can still move by up to ``lr``). This command lines the runs' ``metrics.jsonl``
up by step, compares their latest complete checkpoints tensor by tensor, and says which is
which. Exit status 0: within tolerance; 1: not.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from hybridpar.errors import UserError


def read_losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss from a run's ``metrics.jsonl``."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir} has no metrics.jsonl; pass a run directory (train.run_dir)")
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            out[int(record["step"])] = float(record["loss"])
    return out


def compare_losses(a: dict[int, float], b: dict[int, float]) -> tuple[list[int], float]:
    """Common steps and the largest relative loss difference over them."""
    steps = sorted(set(a) & set(b))
    worst = max((abs(a[s] - b[s]) / max(abs(b[s]), 1e-12) for s in steps), default=0.0)
    return steps, worst


def compare_weights(run_a: Path, run_b: Path) -> tuple[str, str, dict[str, float]] | None:
    """(checkpoint a, checkpoint b, per-tensor max |a - b|) of both runs' latest complete
    checkpoints, or None when either has none."""
    from hybridpar.training.checkpoint import latest_checkpoint, load_model_state

    ca, cb = latest_checkpoint(run_a), latest_checkpoint(run_b)
    if ca is None or cb is None:
        return None
    (_, sa), (_, sb) = load_model_state(ca), load_model_state(cb)
    if sa.keys() != sb.keys():
        raise UserError(f"{ca} and {cb} hold different parameters; the runs trained different models")
    diffs = {}
    for name, ta in sa.items():
        tb = sb[name]
        if ta.shape != tb.shape:
            raise UserError(f"{name} has shape {list(ta.shape)} in {ca} but {list(tb.shape)} in {cb}")
        diffs[name] = float((ta.float() - tb.float()).abs().max())
    return str(ca), str(cb), diffs


# keys that may differ between two runs of one experiment without changing the result: the
# layout (what `compare` exists to check) and where and how often a run writes
LAYOUT_KEYS = ("train.micro_batch", "train.compile", "train.compile_backend", "train.optimizer_impl",
               "train.device", "train.hardware", "train.timeout_s", "async_checkpoint.enabled", "train.auto_resume")
BOOKKEEPING_KEYS = ("train.run_dir", "train.log_every", "train.checkpoint_every", "train.keep_checkpoints",
                    "train.sample_tokens", "train.sample_prompt")


def _flat_config(run_dir: Path) -> dict[str, object] | None:
    """``section.key -> value`` of a run's ``config.json`` (None when it has none)."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        return None
    return {f"{section}.{k}": v for section, keys in json.loads(path.read_text()).items()
            if isinstance(keys, dict) for k, v in keys.items()}


def config_differences(run_a: Path, run_b: Path) -> str:
    """One line naming the config keys that differ between the runs, as ``key a -> b``: first
    those that change the result (a different experiment), then the layout's (expected)."""
    a, b = _flat_config(run_a), _flat_config(run_b)
    if a is None or b is None:
        return "config: one of the runs has no config.json; not compared"
    differ = [k for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k) and k not in BOOKKEEPING_KEYS]
    layout = [k for k in differ if k.startswith("parallel.") or k in LAYOUT_KEYS]
    result = [k for k in differ if k not in layout]

    def show(keys: list[str]) -> str:
        return ", ".join(f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in keys)

    line = f"config: differs in {show(result)} (these change the result)" if result else "config: the same"
    return line + (f"; layout: {show(layout)}" if layout else "; the same layout")


def cmd_compare(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar compare", description=__doc__.splitlines()[0])
    ap.add_argument("run_a")
    ap.add_argument("run_b")
    ap.add_argument("--loss-rtol", type=float, default=1e-5, help="relative loss tolerance (fp32 default)")
    ap.add_argument("--weight-atol", type=float, default=None,
                    help="absolute weight tolerance (default: 1%% of lr x steps of run A's config)")
    args = ap.parse_args(argv)
    a, b = Path(args.run_a), Path(args.run_b)
    steps, loss_diff = compare_losses(read_losses(a), read_losses(b))
    if not steps:
        raise UserError(f"{a} and {b} logged no common step; compare runs of the same config")
    ok = loss_diff <= args.loss_rtol
    print(config_differences(a, b))
    print(f"losses: {len(steps)} common steps ({steps[0]}..{steps[-1]}), largest relative difference "
          f"{loss_diff:.2e} (tolerance {args.loss_rtol:.0e}): {'expected' if ok else 'NOT expected'}")
    weights = compare_weights(a, b)
    if weights is None:
        print("weights: no complete checkpoint in one of the runs; losses only")
    else:
        ca, cb, diffs = weights
        atol = args.weight_atol
        if atol is None:
            cfg = json.loads((Path(ca) / "config.json").read_text())["train"]
            atol = 0.01 * cfg["lr"] * json.loads((Path(ca) / "complete.json").read_text())["step"]
        name, worst = max(diffs.items(), key=lambda kv: kv[1])
        w_ok = worst <= atol or math.isclose(worst, 0.0)
        ok = ok and w_ok
        print(f"weights: {Path(ca).name} vs {Path(cb).name}, largest difference {worst:.2e} in {name} "
              f"(tolerance {atol:.1e}): {'expected' if w_ok else 'NOT expected'}")
    print("verdict: " + ("the runs agree to floating-point tolerance" if ok else
                         "the runs differ by more than layout changes explain (different config, data or a bug)"))
    return 0 if ok else 1
