"""Elastic training (``hybridpar train --elastic MIN:MAX``): a job whose world size changes
between restarts re-plans its layout and continues the same trajectory.

What makes this possible is what the runtime already promises: the global batch, the sampler's
global sample ids and the math do not depend on the layout, and checkpoints reload under any
layout. So when a restart (torchrun's elastic agent after a lost node, or a node that joined)
hands the job another world size, every rank, before any process group exists:

1. plans a layout for the new world (:func:`plan_for_world`): the configured layout when its
   world is this one; else the axes the config fixed (``dp``/``tp``/``pp``/``cp`` above 1) are
   kept as far as their product still divides the world (``dp`` is given up first, then ``cp``,
   ``pp``, ``tp``) and the planner (:mod:`hybridpar.planner.front.auto`) chooses the rest: the same
   pure function on every rank; before the mesh is built the ranks check that they agree
   (:func:`check_same_plan`: nodes with different hardware models would not);
2. refuses (:class:`~hybridpar.config.ConfigError`, exit status 2) when no layout of the new
   world runs: the planner's memory model says the model does not fit, or the world cannot
   divide the global batch; the message names the smallest world that would work;
3. continues from the newest complete checkpoint in ``train.run_dir`` (resharded by the load)
   with the unchanged global batch, learning-rate schedule and data order.

Each layout the run trains under is recorded in ``<run_dir>/layouts.json`` (rank 0, atomically)
as ``{step, world, layout, reason}`` (``step``: the step it continued after), and copied into
``summary.json`` as ``layout_changes``; ``metrics.jsonl`` carries ``world`` on every line.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridpar.config import Config, ConfigError, ParallelConfig
from hybridpar.training.checkpoint import latest_verified_checkpoint, read_info, recover, step_dir

if TYPE_CHECKING:
    from hybridpar.distributed.mesh import Topology

AXES = ("dp", "tp", "pp", "cp")
GIVE_UP_ORDER = ("dp", "cp", "pp", "tp")  # which configured axis a smaller world drops first
HISTORY_FILE = "layouts.json"


@dataclass(frozen=True)
class WorldRange:
    """``--elastic MIN:MAX``: the world sizes (processes) the job may run at."""

    min: int
    max: int

    @classmethod
    def parse(cls, text: str) -> WorldRange:
        """``"4:8"`` (or ``"8"``: exactly 8); a ConfigError naming the value otherwise."""
        parts = text.split(":")
        try:
            lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, 0)
        except ValueError:
            lo = hi = 0
        if lo < 1 or hi < lo:
            raise ConfigError(f"--elastic {text!r} must be MIN:MAX with 1 <= MIN <= MAX world sizes (processes), "
                              "e.g. --elastic 4:8")
        return cls(lo, hi)

    def check(self, world: int) -> None:
        if not self.min <= world <= self.max:
            raise ConfigError(f"the job has {world} processes, outside --elastic {self.min}:{self.max}; "
                              f"launch between {self.min} and {self.max} processes or widen --elastic")


def elastic_nodes(span: WorldRange, nproc: int, multi_node: bool) -> tuple[int, int]:
    """(min, max) nodes of ``nproc`` processes each for ``span``: one node unless the launcher
    joins others (``--rdzv-endpoint``)."""
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc} must be >= 1")
    if not multi_node:
        span.check(nproc)
        return 1, 1
    lo, hi = -(-span.min // nproc), span.max // nproc
    if hi < 1 or lo > hi:
        raise ConfigError(f"--elastic {span.min}:{span.max} holds no whole number of nodes of --nproc {nproc} "
                          f"processes; make MAX a multiple of {nproc} at least {span.min}")
    return lo, hi


@dataclass(frozen=True)
class LayoutChange:
    """The layout a (re)started elastic job trains under and why (one entry of ``layouts.json``
    once the step it continues after is known)."""

    world: int
    layout: str
    reason: str

    def entry(self, step: int) -> dict[str, Any]:
        return {"step": step, "world": self.world, "layout": self.layout, "reason": self.reason}


def layout_name(p: ParallelConfig) -> str:
    """``dp2 tp2 pp2 cp1 zero0`` (and ep when above 1, the recompute mode when one is set)."""
    recompute = f" recompute={p.recompute}" if p.recompute != "none" else ""
    ep = f" ep{p.ep}" if p.ep > 1 else ""
    return f"dp{p.dp}{ep} tp{p.tp} pp{p.pp} cp{p.cp} zero{p.zero_stage}{recompute}"


def _axes(p: ParallelConfig, names: tuple[str, ...] = AXES) -> str:
    return " x ".join(f"{k}={getattr(p, k)}" for k in names) or "none"


def _keeps(fixed: dict[str, int], world: int) -> list[tuple[str, ...]]:
    """Subsets of the configured axes whose product divides ``world``: most kept first, then
    the one that gave up axes earliest in :data:`GIVE_UP_ORDER`."""
    out = []
    for n in range(len(fixed), -1, -1):
        for kept in itertools.combinations(fixed, n):
            product = 1
            for k in kept:
                product *= fixed[k]
            if world % product == 0:
                dropped = sorted(GIVE_UP_ORDER.index(k) for k in fixed if k not in kept)
                out.append((n, dropped, kept))
    out.sort(key=lambda t: (-t[0], t[1]))
    return [kept for _, _, kept in out]


def _with_axes(cfg: Config, axes: dict[str, int]) -> Config:
    """``cfg`` with the mesh axes set to ``axes`` (others 1) and the planner on."""
    par = dataclasses.replace(cfg.parallel, auto=True, **{k: axes.get(k, 1) for k in AXES})
    return dataclasses.replace(cfg, parallel=par)


def plan_for_world(cfg: Config, world: int, local_processes: int | None = None,
                   verbose: bool = False) -> tuple[Config, LayoutChange]:
    """``cfg`` with the layout an elastic job uses on ``world`` processes, and why (see the
    module docstring); a ConfigError naming the smallest world that works when none does."""
    from hybridpar.config import validate

    p = cfg.parallel
    if not p.auto and p.world_size == world:
        validate(cfg, world_size=world)
        return cfg, LayoutChange(world, layout_name(p), f"the configured layout ({_axes(p)})")
    planned = _replan(cfg, world, local_processes)
    if isinstance(planned, list):
        raise ConfigError(_refusal(cfg, world, planned))
    if verbose:
        print(f"hybridpar: elastic: {planned[1].reason}", flush=True)
    return planned


def _replan(cfg: Config, world: int, local_processes: int | None = None) -> tuple[Config, LayoutChange] | list[str]:
    """The planner's layout for ``world`` keeping what it can of the configured axes, or the
    planner's refusals (one per set of kept axes tried)."""
    from hybridpar.planner.front.auto import auto_config

    p = cfg.parallel
    fixed = {k: getattr(p, k) for k in AXES if getattr(p, k) > 1}
    errors: list[str] = []
    for kept in _keeps(fixed, world):
        trial = _with_axes(cfg, {k: fixed[k] for k in kept})
        try:
            planned = auto_config(trial, world, local_processes, verbose=False)
        except ConfigError as e:
            errors.append(str(e))
            continue
        q = planned.parallel
        if p.auto:
            why = f"parallel.auto on {world} processes"
        else:
            gone = [k for k in fixed if k not in kept]
            why = (f"the configured {_axes(p, tuple(fixed))} is {p.world_size} ranks, the world {world}"
                   + (f"; gave up {', '.join(f'{k}={fixed[k]}' for k in gone)}" if gone else "")
                   + (f", kept {', '.join(f'{k}={fixed[k]}' for k in kept)}" if kept else ""))
        sched = f" {q.pipeline_schedule}" + (f"x{q.virtual_stages}" if q.virtual_stages > 1 else "") if q.pp > 1 else ""
        chosen = f"{layout_name(q)} micro-batch {planned.train.micro_batch}{sched}"
        return planned, LayoutChange(world, layout_name(q), f"{why}; the planner chose {chosen}")
    return errors


def _refusal(cfg: Config, world: int, errors: list[str]) -> str:
    """Why no layout of ``world`` processes runs ``cfg``, and the smallest world that would."""
    reason = errors[-1] if errors else "no layout"  # the last try: the planner free to choose every axis
    if ": " in reason:  # the planner's reasons, without its own advice (--nproc)
        reason = reason.split(": ", 1)[1].split("; change the world size")[0]
    smallest = smallest_world(cfg, 1, 4 * world)
    if smallest is None:
        fix = (f"no world of up to {4 * world} processes can run it: change the model, the batch sizes "
               "or the memory settings (parallel.zero_stage, parallel.recompute)")
    else:
        fix = f"the smallest world that can run it is {processes(smallest)}"
        if smallest < world:
            above = smallest_world(cfg, world + 1, 4 * world)
            fix += f" (the next above {world}: {processes(above)})" if above else ""
        fix += "; restart the job on such a world"
    return f"elastic: {processes(world)} cannot continue this job (no layout of {world} runs it: {reason}); {fix}"


def processes(n: int) -> str:
    return f"{n} process{'es' if n != 1 else ''}"


def smallest_world(cfg: Config, start: int, limit: int) -> int | None:
    """The smallest world size in ``start..limit`` that the planner can run ``cfg`` on (keeping
    what it can of the configured axes), or None."""
    return next((w for w in range(max(start, 1), limit + 1) if not isinstance(_replan(cfg, w), list)), None)


def check_same_plan(cfg: Config, world: int, device_type: str) -> None:
    """Every rank planned on its own (:func:`plan_for_world`); make sure they agree before the
    mesh is built, since ranks with different layouts would build different process groups and
    hang. Plans differ when nodes see different hardware models (a calibrated profile on some
    nodes only). Collective over the world: one 8-byte all-gather on a flat mesh."""
    import zlib

    import torch

    from hybridpar.distributed.mesh import ParallelDims

    plan = json.dumps([dataclasses.asdict(cfg.parallel), cfg.train.micro_batch], sort_keys=True)
    mine = torch.tensor([zlib.crc32(plan.encode())], dtype=torch.int64)
    with ParallelDims.from_config(ParallelConfig(dp=world)).build(device_type) as flat:
        plans = flat.comm.all_gather(mine, flat.world).tolist()
    if len(set(plans)) > 1:
        raise ConfigError(f"elastic: the {world} processes planned different layouts (this one: "
                          f"{layout_name(cfg.parallel)}, micro-batch {cfg.train.micro_batch}); every node must plan "
                          "alike: set train.hardware (a GPU name or one calibrated profile every node reads)")


# ----------------------------------------------------------------------------- the launcher's settings


def parse_rdzv_conf(text: str | None) -> dict[str, str]:
    """``--rdzv-conf a=1,b=2`` as a dict (torchrun's syntax)."""
    if not text:
        return {}
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if any(len(p) != 2 or not p[0] for p in pairs):
        raise ConfigError(f"--rdzv-conf {text!r} must be KEY=VALUE pairs separated by commas, "
                          "e.g. last_call_timeout=5,keep_alive_interval=1")
    return {k: v for k, v in pairs}


def default_rdzv_id(run_dir: Path, endpoint: str | None) -> str:
    """The rendezvous id when ``--rdzv-id`` is not given: one job per run directory (every
    node's command names the same ``train.run_dir``); a fresh one for a one-node job."""
    if endpoint is None:
        import uuid

        return str(uuid.uuid4())
    import hashlib

    return "hybridpar-" + hashlib.sha256(str(run_dir).encode()).hexdigest()[:16]


def shared_store_warning(environ: Mapping[str, str]) -> str | None:
    """Under an external torchrun whose agents share their store with the workers (its default),
    a node joining the running job hangs in the rendezvous: what rank 0 of a first attempt says."""
    from hybridpar.distributed.launch import SHARED_STORE_ENV
    from hybridpar.distributed.lifecycle import ERROR_DIR_ENV

    if (environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and ERROR_DIR_ENV not in environ
            and environ.get("RANK") == "0" and environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")):
        return (f"--elastic under torchrun: export {SHARED_STORE_ENV}=1 on every node, or a node that joins "
                "the running job waits in torch's rendezvous until it times out")
    return None


# What gloo and NCCL say when a peer process is gone (its node lost): a collective that cannot finish.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited")


def peer_lost(error: BaseException) -> str | None:
    """The backend's words when ``error`` is a collective that failed because a peer died, else None."""
    text = str(error)
    return next((needle for needle in PEER_LOST if needle in text), None)


# ----------------------------------------------------------------------------- the record


def history(run_dir: Path) -> list[dict[str, Any]]:
    """The layouts this run trained under (``layouts.json``), oldest first; [] if none."""
    path = Path(run_dir) / HISTORY_FILE
    return json.loads(path.read_text()) if path.is_file() else []


def record(run_dir: Path, change: LayoutChange, step: int) -> list[dict[str, Any]]:
    """Append ``change`` (continuing after ``step``) to ``layouts.json`` unless the run already
    trains under that world and layout; entries after ``step`` (training that a restart redoes)
    are dropped. Rank 0 only. Returns the history."""
    from hybridpar.training.metrics import atomic_write_text

    entries = [e for e in history(run_dir) if e["step"] <= step]
    if not entries or (entries[-1]["world"], entries[-1]["layout"]) != (change.world, change.layout):
        entries.append(change.entry(step))
    atomic_write_text(Path(run_dir) / HISTORY_FILE, json.dumps(entries, indent=2) + "\n")
    return entries


def agreed_latest_checkpoint(topo: Topology, run_dir: Path, fallback: Path | None,
                             elastic: LayoutChange | None = None, restart: int = 0,
                             layout: str | None = None) -> Path | None:
    """Where a restarted job continues, the same on every rank: the newest in-memory snapshot every
    rank's shard is held for (``layout``: this job's, when it takes snapshots; see
    :func:`agreed_snapshot`) unless a disk checkpoint is newer, else the newest complete checkpoint
    in ``run_dir`` as rank 0 sees it (a broadcast of its step), else ``fallback`` (``--resume``;
    None: start over). Used when torchrun restarted the job after a failure
    (``train.auto_resume``). Newer checkpoints that fail their checksums are skipped, and rank 0
    says which and why. ``restart``: torchrun's restart count."""
    what = f"restart {restart} of the job (torchrun --max-restarts)"
    if elastic is not None:
        what = f"elastic: {processes(topo.world_size)}, layout {elastic.layout}"
    snap, said = agreed_snapshot(topo, run_dir, layout)
    if snap is not None:
        if topo.rank == 0:
            print(f"hybridpar: {what}: {said}", flush=True)
        return snap
    found = None
    if topo.rank == 0:  # the others wait in the broadcast while rank 0 tidies and checks the checksums
        recover(run_dir)
        found, skipped = latest_verified_checkpoint(run_dir)
        for _, why in skipped:
            print(f"hybridpar: skipping checkpoint {why}", flush=True)
    step = torch.tensor([int(read_info(found)["step"]) if found is not None else -1], dtype=torch.int64)
    topo.comm.broadcast(step, topo.world, src=0)
    chosen = step_dir(run_dir, int(step)) if int(step) >= 0 else fallback
    if topo.rank == 0:
        resuming = f"resuming from {chosen}" if chosen else "no complete checkpoint yet, starting over"
        print(f"hybridpar: {what}: {said}{resuming}", flush=True)
    return chosen


def agreed_snapshot(topo: Topology, run_dir: Path, layout: str | None) -> tuple[Path | None, str]:
    """The newest in-memory snapshot of ``layout`` every rank's shard is held for in the node
    stores, fetched from peers where needed (collective), when it is at least as new as the newest
    disk checkpoint (read from its ``complete.json`` only); and rank 0's words for it. (None, the
    start of the words for a disk fallback) when there is none or the job takes no snapshots."""
    from hybridpar.training.checkpoint import latest_checkpoint
    from hybridpar.training.checkpoint.snapshot import step_of, store_dir
    from hybridpar.training.checkpoint.snapshot_peers import agree

    store = store_dir()
    if layout is None or store is None:
        return None, ""
    snap, fetched = agree(topo, store, layout)
    disk = latest_checkpoint(run_dir)
    disk_step = int(read_info(disk)["step"]) if disk is not None else -1
    if snap is None:
        return None, "no complete in-memory snapshot in the node stores, falling back to the disk checkpoint: "
    if step_of(snap) < disk_step:
        return None, f"the disk checkpoint is newer than the in-memory snapshot of step {step_of(snap)}: "
    peers = f", {fetched} shard{'s' if fetched != 1 else ''} from a peer node's replica" if fetched else ""
    return snap, (f"resuming from the in-memory snapshot of step {step_of(snap)} ({store}{peers}); "
                  "the disk checkpoint is not read")
