"""``hybridpar compare RUN_A RUN_B``: is the difference between two runs expected?

Two runs of the same config under different layouts should agree to floating-point tolerance:
losses to about 1e-5 relative in fp32 (only the order of summations differs), weights to a
small multiple of ``lr`` per step (Adam divides by sqrt(v), so an entry whose gradient is pure
rounding noise can still move by up to ``lr``). This command lines the runs' ``metrics.jsonl``
up by step, compares their latest complete checkpoints tensor by tensor, and says which is
which. Exit status 0: within tolerance; 1: not.

**FP8 runs** (``fp8.recipe`` in both) are held to a tolerance derived from the format instead.
An e4m3 value has 3 mantissa bits, so neighbours are one step = 2**-3 of the value's binade
apart, and a cast rounds to the nearer one. Two layouts' fp32 inputs to a cast differ by a last
bit wherever they sum in another order (the gradients of more micro-batches per rank, a GEMM's
blocking); a value that lies within that last bit of a midpoint then lands one e4m3 step apart
(a flip). A flip is as large as the format's own rounding (half a step) twice over, so it is no
bug, but it does not stay small: Adam divides by ``sqrt(v)``, so an element whose gradient the
flip changes may take an update of up to ``lr_t`` in either direction at step ``t`` (Kingma
and Ba's bound on Adam's effective step, section 2.1: ``lr_t`` when ``1 - beta1 <= sqrt(1 -
beta2)``, as with the defaults 0.9 and 0.95, else ``lr_t (1 - beta1) / sqrt(1 - beta2)``). Two runs' weights can
so part by ``2 sum_t lr_t * max(1, (1 - beta1) / sqrt(1 - beta2))`` per element over the run
(:func:`fp8_weight_tolerance`): the default weight tolerance of FP8 runs, and losses are held to
``--loss-rtol`` at the first logged step only (one weight update at most; later losses follow
the weights and are shown, not judged). ``tests/test_fp8_layouts.py`` holds every layout to the
tighter bound a test can measure (twice the FP8 run's distance from the unquantized one).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from hybridpar.config import TrainConfig
from hybridpar.errors import UserError
from hybridpar.training.optim import lr_at


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


def fp8_recipe(run_dir: Path) -> str:
    """The run's ``fp8.recipe`` from its ``config.json`` (``"none"`` without one or without FP8;
    the old spelling ``train.fp8`` read too)."""
    flat = _flat_config(run_dir) or {}
    return str(flat.get("fp8.recipe", flat.get("train.fp8", "none")) or "none")


def fp8_weight_tolerance(train: dict[str, object], step: int) -> float:
    """The largest per-element weight difference two FP8 runs of one config may show after
    ``step`` steps (module doc): ``2 sum_t lr_t`` times Adam's per-step bound on ``|update| / lr``."""
    names = {f for f in TrainConfig.__dataclass_fields__}
    cfg = TrainConfig(**{k: v for k, v in train.items() if k in names})  # type: ignore[arg-type]
    adam = max(1.0, (1 - cfg.beta1) / math.sqrt(1 - cfg.beta2))
    return 2 * adam * sum(lr_at(t, cfg) for t in range(1, step + 1))


def _weights_verdict(ca: str, cb: str, diffs: dict[str, float], atol: float | None, fp8: bool) -> bool:
    """Print the weights' line and say whether they agree (default tolerance: 1% of lr x steps,
    FP8 runs :func:`fp8_weight_tolerance`)."""
    if atol is None:
        cfg = json.loads((Path(ca) / "config.json").read_text())["train"]
        step = json.loads((Path(ca) / "complete.json").read_text())["step"]
        atol = fp8_weight_tolerance(cfg, step) if fp8 else 0.01 * cfg["lr"] * step
    name, worst = max(diffs.items(), key=lambda kv: kv[1])
    ok = worst <= atol or math.isclose(worst, 0.0)
    why = ", FP8: 2 x the lr summed over the steps, Adam's bound after an e4m3 rounding flip" if fp8 else ""
    print(f"weights: {Path(ca).name} vs {Path(cb).name}, largest difference {worst:.2e} in {name} "
          f"(tolerance {atol:.1e}{why}): {'expected' if ok else 'NOT expected'}")
    return ok


def cmd_compare(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar compare", description=__doc__.splitlines()[0])
    ap.add_argument("run_a")
    ap.add_argument("run_b")
    ap.add_argument("--loss-rtol", type=float, default=1e-5, help="relative loss tolerance (fp32 default)")
    ap.add_argument("--weight-atol", type=float, default=None,
                    help="absolute weight tolerance (default: 1%% of lr x steps of run A's config; FP8 runs: "
                         "2 x the sum of the steps' lr, the bound after an e4m3 rounding flip)")
    args = ap.parse_args(argv)
    a, b = Path(args.run_a), Path(args.run_b)
    losses_a, losses_b = read_losses(a), read_losses(b)
    steps, loss_diff = compare_losses(losses_a, losses_b)
    if not steps:
        raise UserError(f"{a} and {b} logged no common step; compare runs of the same config")
    fp8 = fp8_recipe(a) != "none" and fp8_recipe(b) != "none"
    print(config_differences(a, b))
    if fp8:  # judged at the first common step only (module doc); all of them shown
        first = compare_losses({steps[0]: losses_a[steps[0]]}, {steps[0]: losses_b[steps[0]]})[1]
        ok = first <= args.loss_rtol
        print(f"losses: {len(steps)} common steps ({steps[0]}..{steps[-1]}), largest relative difference "
              f"{loss_diff:.2e}; FP8 runs: step {steps[0]} {first:.2e} (tolerance {args.loss_rtol:.0e}): "
              f"{'expected' if ok else 'NOT expected'} (later FP8 losses follow the weights)")
    else:
        ok = loss_diff <= args.loss_rtol
        print(f"losses: {len(steps)} common steps ({steps[0]}..{steps[-1]}), largest relative difference "
              f"{loss_diff:.2e} (tolerance {args.loss_rtol:.0e}): {'expected' if ok else 'NOT expected'}")
    weights = compare_weights(a, b)
    if weights is None:
        print("weights: no complete checkpoint in one of the runs; losses only")
    else:
        ok = _weights_verdict(*weights, args.weight_atol, fp8) and ok
    print("verdict: " + ("the runs agree to floating-point tolerance" if ok else
                         "the runs differ by more than layout changes explain (different config, data or a bug)"))
    return 0 if ok else 1
