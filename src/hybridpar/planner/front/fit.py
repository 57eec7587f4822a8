"""Learning from runs: fit the efficiency model (:mod:`hybridpar.planner.machine.efficiency`) to what a
``hybridpar train`` run measured, and re-plan with it.

A run directory holds ``config.json`` (model, layout, batch, precision, compile), ``metrics.jsonl``
(``step_time_s`` per logged interval: the mean over the steps since the previous line) and
``summary.json`` (``peak_memory_bytes_per_rank``). :func:`read_run` turns that into a
:class:`RunRecord`: the layout and workload as the planner names them, the measured step time
(median of the logged intervals after step 1, which holds start-up and compilation) and the
measured peak memory.

What is fitted: multipliers of the time of each kernel class (:data:`hybridpar.planner.machine.efficiency.CLASSES`:
GEMM, attention, memory-bound, launches), never of communication or of the step as a whole. With
one run there is one number to match, so one multiplier is fitted, shared by all four compute
classes (the device computes at a fraction of what the spec says); with two or more runs, two:
one for the arithmetic classes (GEMM, attention) and one for the memory-bound and launch
classes, by least squares on the logarithm of predicted / measured (Gauss-Newton with numerical
derivatives through the full cost model, pipeline schedule and overlaps included). The fitted
device is written as a profile (``hybridpar calibrate --from-run DIR --out FILE``, an
``[efficiency]`` table) that ``hybridpar plan --gpu FILE`` and ``train --parallel.auto``
(``train.hardware``) read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from hybridpar.config import Config, ModelConfig, parse_config
from hybridpar.planner.machine.allocator import cpu_resident_bytes, measured_cpu_baseline
from hybridpar.planner.machine.efficiency import CLASSES, efficiency_of, to_table
from hybridpar.planner.machine.hardware import (
    _FIELDS,
    CPU_CORE,
    Cluster,
    GPUSpec,
    PlanError,
    gpu_spec,
    load_gpu_toml,
)
from hybridpar.planner.machine.profile import default_profile_path, to_toml
from hybridpar.planner.memory.plan import plan_memory, rank_memory
from hybridpar.planner.model.layout import LAYOUT_KEYS, BlockStyle, Layout, Workload
from hybridpar.planner.price.cost import step_cost


@dataclass(frozen=True)
class RunRecord:
    """One training run as the planner sees it (see the module doc)."""

    path: Path
    model: ModelConfig
    layout: Layout
    work: Workload
    world: int
    device: str  # "cpu" or "cuda" (the run's train.device; "auto" is read as what the run logged)
    step_time_s: float  # median measured step time
    steps_timed: int
    peak_memory: tuple[int, ...]  # per rank (allocator peak on GPUs, peak resident set on CPU)
    hardware: str  # the run's train.hardware (may be empty)


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"--from-run: cannot read {path}: {e}") from None


def _step_times(metrics: Path) -> list[float]:
    """The logged ``step_time_s`` of every line after step 1 (:func:`warm_step_times`)."""
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return warm_step_times(rows)


def warm_step_times(rows: list[object]) -> list[float]:
    """The ``step_time_s`` of every ``metrics.jsonl`` record after step 1, which holds start-up
    and compilation: the step times after warm-up that a run's prediction is checked against."""
    return [float(row["step_time_s"]) for row in rows
            if isinstance(row, dict) and row.get("step", 0) > 1 and isinstance(row.get("step_time_s"), int | float)]


def training_run(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds what :func:`read_run` needs (``config.json`` and ``metrics.jsonl``)."""
    return (Path(run_dir) / "config.json").is_file() and (Path(run_dir) / "metrics.jsonl").is_file()


def read_run(run_dir: str | Path) -> RunRecord:
    """The :class:`RunRecord` of a ``hybridpar train`` run directory; a :class:`PlanError`
    naming what is missing otherwise."""
    root = Path(run_dir)
    if not training_run(root):
        raise PlanError(f"--from-run {str(run_dir)!r} is not a training run directory (no config.json and "
                        "metrics.jsonl); give a run's train.run_dir")
    doc = _read_json(root / "config.json")
    if not isinstance(doc, dict):
        raise PlanError(f"--from-run: {root / 'config.json'} is not a config")
    cfg = parse_config(doc, str(root / "config.json"))
    train = cfg.train
    times = _step_times(root / "metrics.jsonl")
    if not times:
        raise PlanError(f"--from-run: {root / 'metrics.jsonl'} logs no step_time_s after step 1; train a few "
                        "steps more (or --train.log_every 1)")
    summary = _read_json(root / "summary.json") if (root / "summary.json").is_file() else {}
    peaks = tuple(int(x) for x in summary.get("peak_memory_bytes_per_rank", [])) if isinstance(summary, dict) else ()
    device = train.device if train.device in ("cpu", "cuda") else ("cuda" if _logged_gpu(root) else "cpu")
    return run_record(cfg, root, device, times, peaks)


def run_record(cfg: Config, root: Path, device: str, times: list[float], peaks: tuple[int, ...]) -> RunRecord:
    """The :class:`RunRecord` of a run of ``cfg`` in ``root`` on ``device`` whose warm step times
    were ``times`` (median taken; 0 when none) and per-rank peaks ``peaks``."""
    layout, work = layout_and_workload(cfg)
    return RunRecord(root, cfg.model, layout, work, layout.world_size, device,
                     statistics.median(times) if times else 0.0, len(times), peaks, cfg.train.hardware)


def layout_and_workload(cfg: Config) -> tuple[Layout, Workload]:
    """The planner's :class:`Layout` and :class:`Workload` of a training config: what the run of
    ``cfg`` executes (its micro-batch, autocast with fp32 master weights, its block style, loss
    chunking and FP8 recipe), so the planner prices the run itself."""
    par, train = cfg.parallel, cfg.train
    layout = Layout(**{k: getattr(par, k) for k in LAYOUT_KEYS if k != "micro_batch"}, micro_batch=train.micro_batch)
    style = BlockStyle.COMPILED if train.compile else BlockStyle.EAGER
    work = Workload(train.global_batch, train.seq_len, train.precision, half_params=False, bucket_mb=par.bucket_mb,
                    style=style, loss_chunk_tokens=train.loss_chunk_tokens, fp8=cfg.fp8.recipe,
                    fp8_all_gather=cfg.fp8.all_gather)
    return layout, work


def _logged_gpu(root: Path) -> bool:
    """Whether an ``auto``-device run ran on a GPU: its log names the device (``on N x cuda``)."""
    log = root / "train.log"
    return log.is_file() and " x cuda" in log.read_text(errors="replace")


def base_gpu(run: RunRecord, override: str | None = None) -> tuple[GPUSpec, str, Path | None]:
    """(device model to fit from, where it came from, its profile file if it is one): ``--gpu``
    when given, else the run's
    ``train.hardware``, else for a GPU run the H100 data sheet, for a CPU run the calibrated
    default profile if one was written, else the built-in CPU core
    (:func:`hybridpar.planner.front.auto.resolve_hardware`'s choices, without a device to ask)."""
    for name, source in ((override, f"--gpu {override}"), (run.hardware, f"the run's train.hardware {run.hardware!r}")):
        if name:
            return gpu_spec(name), source, Path(name) if name.endswith(".toml") else None
    if run.device == "cuda":
        return gpu_spec("H100-SXM"), "H100-SXM data sheet (pass --gpu to name the run's device)", None

    default = default_profile_path()
    if default.is_file():
        return gpu_spec(str(default)), f"calibrated profile {default}", default
    return CPU_CORE, "built-in CPU core spec", None


def predict(run: RunRecord, gpu: GPUSpec, gpus_per_node: int | None = None) -> float:
    """Predicted step time of the run's layout on ``gpu`` (one node of the run's world size)."""
    cluster = Cluster.of(gpu, run.world, gpus_per_node or run.world)
    return step_cost(run.model, run.layout, run.work, cluster).step_time_s


def with_fit(gpu: GPUSpec, fit: tuple[float, ...]) -> GPUSpec:
    """``gpu`` with the class multipliers ``fit`` (:data:`CLASSES` order) in its efficiency."""
    eff = efficiency_of(gpu)
    return dataclasses.replace(gpu, efficiency=dataclasses.replace(eff, fit=tuple(fit)))  # type: ignore[arg-type]


def _expand(params: list[float], groups: tuple[tuple[int, ...], ...], base: tuple[float, ...]) -> tuple[float, ...]:
    """Class multipliers from the fitted parameters (log scale), one per group of classes."""
    fit = list(base)
    for p, group in zip(params, groups, strict=True):
        for i in group:
            fit[i] = base[i] * math.exp(p)
    return tuple(fit)


def fit_runs(runs: list[RunRecord], gpu: GPUSpec, iterations: int = 12) -> GPUSpec:
    """``gpu`` with its class multipliers fitted to ``runs`` (module doc): one shared multiplier
    for one run, (arithmetic, memory-bound + launch) for more; Gauss-Newton on log residuals."""
    if not runs:
        raise PlanError("--from-run: no runs to fit")
    groups: tuple[tuple[int, ...], ...] = ((0, 1, 2, 3),) if len(runs) == 1 else ((0, 1), (2, 3))
    base = efficiency_of(gpu).fit
    params = [0.0] * len(groups)

    def residuals(ps: list[float]) -> list[float]:
        g = with_fit(gpu, _expand(ps, groups, base))
        return [math.log(predict(r, g) / r.step_time_s) for r in runs]

    for _ in range(iterations):
        res = residuals(params)
        if max(abs(x) for x in res) < 1e-6:
            break
        h = 1e-4
        cols = [[(a - b) / h for a, b in zip(residuals([p + h * (i == j) for j, p in enumerate(params)]), res,
                                             strict=True)] for i in range(len(params))]
        step = _least_squares(cols, res)
        params = [p - s for p, s in zip(params, step, strict=True)]
    return with_fit(gpu, _expand(params, groups, base))


def _least_squares(cols: list[list[float]], res: list[float]) -> list[float]:
    """Solve ``J x = res`` in the least-squares sense for one or two columns (normal equations;
    a singular system falls back to moving every parameter together)."""
    if len(cols) == 1:
        jj = sum(x * x for x in cols[0])
        return [sum(x * r for x, r in zip(cols[0], res, strict=True)) / jj if jj > 0 else 0.0]
    a, b = cols
    aa, ab, bb = sum(x * x for x in a), sum(x * y for x, y in zip(a, b, strict=True)), sum(y * y for y in b)
    ar, br = sum(x * r for x, r in zip(a, res, strict=True)), sum(y * r for y, r in zip(b, res, strict=True))
    det = aa * bb - ab * ab
    if abs(det) < 1e-12 * max(aa * bb, 1e-300):
        both = [x + y for x, y in zip(a, b, strict=True)]
        s = _least_squares([both], res)[0]
        return [s, s]
    return [(bb * ar - ab * br) / det, (aa * br - ab * ar) / det]


def describe_fit(gpu: GPUSpec) -> str:
    """``gemm x1.23, attention x1.23, ...``: the fitted multipliers of each class's time."""
    return ", ".join(f"{c} x{f:.3g}" for c, f in zip(CLASSES, efficiency_of(gpu).fit, strict=True))


def profile_text(gpu: GPUSpec, base_file: Path | None, header: str) -> str:
    """A profile TOML for the fitted ``gpu``: the base profile's text (a calibrated profile keeps
    its measured tables) or every ``[gpu]`` constant, then its ``[efficiency]`` table."""
    eff_lines = ["[efficiency]"] + [line for line in to_toml({}, to_table(efficiency_of(gpu)), [], "").splitlines()
                                    if " = " in line or line.startswith(("  ", "]"))]
    if base_file is not None:
        kept, skipping = [], False
        for line in base_file.read_text().splitlines():
            if line.strip().startswith("["):
                skipping = line.strip() == "[efficiency]"
            if not skipping:
                kept.append(line)
        return "\n".join([f"# {header}", *kept, "", *eff_lines]) + "\n"
    values = {k: getattr(gpu, k) for k in _FIELDS}
    text = to_toml(values, {}, [], header)
    return text.replace("\n[calibration]\n", "\n") + "\n" + "\n".join(eff_lines) + "\n"


@dataclass
class FittedRuns:
    """``plan --from-run``: the runs, the device fitted to them and the predictions for each
    run's own layout before and after the fit."""

    runs: list[RunRecord]
    base: GPUSpec
    source: str
    gpu: GPUSpec
    model_name: str
    base_file: Path | None = None

    def workload(self, global_batch: int, seq_len: int, imbalance: float) -> Workload:
        """The first run's workload (its precision as this runtime runs it, block style, loss
        chunking) at the batch and sequence being planned."""
        return dataclasses.replace(self.runs[0].work, global_batch=global_batch, seq_len=seq_len,
                                   moe_imbalance=imbalance)

    def rows(self) -> list[dict[str, object]]:
        """Per run: measured, predicted before and after the fit (s), memory measured and predicted
        (:func:`predicted_peak`)."""
        out = []
        for r in self.runs:
            before, after = predict(r, self.base), predict(r, self.gpu)
            out.append({"run": str(r.path), "layout": r.layout.short(), "micro_batch": r.layout.micro_batch,
                        "measured_step_s": r.step_time_s, "steps_timed": r.steps_timed,
                        "predicted_before_s": before, "predicted_after_s": after,
                        "moved": after / before - 1, "error_after": after / r.step_time_s - 1,
                        "measured_peak_bytes": max(r.peak_memory, default=0),
                        "predicted_peak_bytes": predicted_peak(r)})
        return out

    def to_json(self) -> dict[str, object]:
        return {"device": self.source, "fit": dict(zip(CLASSES, efficiency_of(self.gpu).fit, strict=True)),
                "runs": self.rows()}

    def lines(self) -> list[str]:
        """What ``plan --from-run`` prints before the plan."""
        out = [f"from {len(self.runs)} run(s), device model {self.source}; fitted time multipliers: "
               f"{describe_fit(self.gpu)}"]
        for row in self.rows():
            out.append(f"  {row['run']}: {row['layout']} micro-batch {row['micro_batch']}: measured "
                       f"{row['measured_step_s']:.4f} s/step (median of {row['steps_timed']} logged intervals); "
                       f"predicted {row['predicted_before_s']:.4f} s before the fit, {row['predicted_after_s']:.4f} s "
                       f"after ({100 * float(row['moved']):+.1f}%; {100 * float(row['error_after']):+.1f}% from measured)")
            if row["measured_peak_bytes"]:
                out.append(f"    peak memory: measured {int(row['measured_peak_bytes']) / 2**30:.2f} GiB, predicted "
                           f"{float(row['predicted_peak_bytes']) / 2**30:.2f} GiB")
        return out


def predicted_peak(run: RunRecord) -> float:
    """The planner's prediction of what the run logged as peak memory, on its worst pipeline
    rank (:func:`predicted_rank_peak`)."""
    return predicted_rank_peak(run.model, run.layout, run.work, run.device)


def predicted_rank_peak(model: ModelConfig, layout: Layout, work: Workload, device: str,
                        pp_rank: int | None = None, cpu_baseline: float | None = None) -> float:
    """The planner's prediction of the peak memory a run logs for pipeline rank ``pp_rank``
    (default: the worst, :func:`~hybridpar.planner.memory.plan.plan_memory`): on CPU the resident
    set (:func:`hybridpar.planner.machine.allocator.cpu_resident_bytes`, with the baseline measured
    in this environment by a fresh interpreter, :func:`~hybridpar.planner.machine.allocator.measured_cpu_baseline`,
    unless ``cpu_baseline`` gives it), on GPUs the allocator's peak of allocated bytes
    (``max_memory_allocated``: the live tensors, without the ``overhead`` the context and
    fragmentation add to what is reserved)."""
    mem = plan_memory(model, layout, work) if pp_rank is None else rank_memory(model, layout, work, pp_rank)
    live = mem.total - mem.components["overhead"]
    if device != "cpu":
        return live
    layers = model.n_layers / layout.pp
    layer_acts = mem.components["activations"] / max(1, mem.in_flight) / layers
    # a CPU run read from its directory ran here: the baseline measured in this environment
    baseline = measured_cpu_baseline() if cpu_baseline is None else cpu_baseline
    return cpu_resident_bytes(live, layer_acts, mem.components["params"] / work.param_bytes, baseline)


def from_run(args: object) -> FittedRuns:
    """Read ``args.from_run``'s runs, fit the device to them, and fill the plan's unset
    ``--model``, ``--gpus``, ``--global-batch`` and ``--seq-len`` from the first run."""
    runs = [read_run(d) for d in args.from_run]  # type: ignore[attr-defined]
    base, source, base_file = base_gpu(runs[0], args.gpu)  # type: ignore[attr-defined]
    fitted = fit_runs(runs, base)
    first = runs[0]
    name = f"run:{first.path}"
    defaults = {"model": name, "gpus": first.world, "global_batch": first.work.global_batch,
                "seq_len": first.work.seq_len}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return FittedRuns(runs, base, source, fitted, name, base_file)


def write_profile(fitted: FittedRuns, out: Path) -> Path:
    """``calibrate --from-run``: the fitted device as a profile at ``out`` (checked by loading
    it back before it replaces anything)."""
    runs = ", ".join(str(r.path) for r in fitted.runs)
    text = profile_text(fitted.gpu, fitted.base_file,
                        f"Fitted by hybridpar calibrate --from-run {runs} from {fitted.source}. Use: hybridpar plan "
                        f"--gpu {out}; hybridpar train --parallel.auto true --train.hardware {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    load_gpu_toml(tmp)
    tmp.replace(out)
    return out
