"""Command line: ``hybridpar train [--config FILE] [--nproc N] [--section.key value ...]``.

A thin entry point: parse, validate (before any process exists), then either launch N local
processes through torch's own launcher or, inside a launched process, build the topology and
hand over to the Trainer.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from hybridpar.config import (
    Config,
    ConfigError,
    ModelConfig,
    config_warnings,
    load_config,
    validate,
)
from hybridpar.errors import UserError
from hybridpar.training.errors import NonFiniteLossError

if TYPE_CHECKING:
    import torch

    from hybridpar.distributed.lifecycle import StopRequest
    from hybridpar.distributed.mesh import Topology
    from hybridpar.training.elastic import LayoutChange

LAUNCHER_VARS = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def under_launcher() -> bool:
    """True inside a process started by torchrun / torch.distributed.run."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def restart_count() -> int:
    """How often torchrun has restarted this job's workers (``--max-restarts``); 0 on the first attempt."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


# `hybridpar train` with no arguments at all: the built-in demo, a 3D layout on 8 local processes
# (about 1 s per step on a 2-core CPU; 300 steps of the tiny preset).
DEMO_LAYOUT = ("--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2", "--train.micro_batch", "4")


def _train_parser() -> argparse.ArgumentParser:
    from hybridpar.cli_text import config_keys

    p = argparse.ArgumentParser(
        prog="hybridpar train",
        description="Train a Llama-style model. Any config key can be overridden as --section.key value, "
        "e.g. --train.steps 50 --parallel.dp 2. --dry-run: check the run on a fake cluster in this process "
        "(--dry-run --help).",
        epilog=config_keys(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML file with [model], [parallel], [train] tables")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                   help="continue from the latest complete checkpoint in train.run_dir, or from CHECKPOINT")
    p.add_argument("--nproc", type=int, default=None, help="local processes to launch (default: the layout's world size dp*tp*pp*cp)")
    p.add_argument("--max-restarts", type=int, default=None, metavar="K",
                   help="with local processes: when one fails, restart all of them up to K times; each "
                   "restart continues from the latest complete checkpoint (train.auto_resume)")
    p.add_argument("--elastic", default=None, metavar="MIN:MAX",
                   help="elastic job of MIN to MAX processes: a restart with another world size re-plans the "
                   "layout and continues from the latest complete checkpoint (also inside torchrun --nnodes A:B)")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="with --elastic: join the other nodes' launchers at HOST:PORT (c10d rendezvous; "
                   "this node runs --nproc of the processes)")
    p.add_argument("--rdzv-id", default=None, metavar="ID",
                   help="with --rdzv-endpoint: the job's id, the same on every node (default: from train.run_dir)")
    p.add_argument("--rdzv-conf", default=None, metavar="KEY=VALUE,...",
                   help="with --elastic: torch's c10d rendezvous settings, as torchrun's --rdzv-conf (e.g. "
                   "last_call_timeout=5,keep_alive_interval=1: how long to wait for more nodes and to notice a lost one)")
    return p


def cmd_train(argv: list[str]) -> int:
    if "--dry-run" in argv:  # a fake cluster in this process: no launch (hybridpar.training.dryrun_cli)
        from hybridpar.training.dryrun_cli import cmd_dry_run
        return cmd_dry_run(argv)
    if not argv:  # the demo; any argument at all means the user's own config (defaults: 1 process)
        argv = [*DEMO_LAYOUT] if under_launcher() else ["--nproc", "8", *DEMO_LAYOUT]
        if not under_launcher():
            print(f"hybridpar: no arguments: the built-in demo, as `hybridpar train {' '.join(argv)}`", flush=True)
    args, overrides = _train_parser().parse_known_args(argv)
    cfg = load_config(args.config, overrides, init_model=_hf_model)
    if under_launcher():
        return _train_under_launcher(cfg, args)
    if args.elastic is not None:
        return _launch_elastic(cfg, args, argv)
    if args.rdzv_endpoint is not None or args.rdzv_id is not None or args.rdzv_conf is not None:
        raise ConfigError("--rdzv-endpoint, --rdzv-id and --rdzv-conf need --elastic MIN:MAX (the job's world sizes)")
    if cfg.parallel.auto:  # plan here, once; launched workers get the layout pinned
        from hybridpar.planner.front.auto import auto_config, layout_overrides

        cfg = auto_config(cfg, args.nproc)
        argv = [*argv, *layout_overrides(cfg)]
    nproc = args.nproc if args.nproc is not None else cfg.parallel.world_size
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc} must be >= 1")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts} must be >= 0")
    resume = _preflight(cfg, nproc, args.resume)
    if args.max_restarts:  # the launcher keeps in-memory snapshots: refuse now those that cannot fit
        from hybridpar.training.checkpoint.snapshot import check_budget

        check_budget(cfg, nproc, multi_node=False)
    from hybridpar.training.rundir import hold_run_dir

    with hold_run_dir(Path(cfg.train.run_dir), " ".join(["hybridpar", "train", *argv])):  # the job's life
        if nproc == 1 and not args.max_restarts:
            return _run_worker(cfg, resume)
        from hybridpar.distributed.launch import launch_local, strip_launcher_options

        print(f"hybridpar: launching {nproc} local processes", flush=True)
        return launch_local(nproc, ["train", *strip_launcher_options(argv)], max_restarts=args.max_restarts or 0,
                            run_dir=Path(cfg.train.run_dir), command=["hybridpar", "train", *argv])


def _train_under_launcher(cfg: Config, args: argparse.Namespace) -> int:
    """``hybridpar train`` as a worker of an external torchrun launch (its options refused here)."""
    if args.nproc is not None:
        raise ConfigError("--nproc cannot be combined with an external torchrun launch; "
                          "drop --nproc and set the process count with torchrun --nproc-per-node")
    if args.max_restarts is not None:
        raise ConfigError("--max-restarts cannot be combined with an external torchrun launch; "
                          "pass --max-restarts to torchrun instead")
    if args.rdzv_endpoint is not None or args.rdzv_id is not None or args.rdzv_conf is not None:
        raise ConfigError("--rdzv-endpoint / --rdzv-id / --rdzv-conf are the local launcher's; under torchrun "
                          "pass them to torchrun instead")
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None
    change = None
    if args.elastic is not None:  # every rank plans the same layout for this world; rank 0 says why
        from hybridpar.training.elastic import WorldRange, plan_for_world, shared_store_warning

        WorldRange.parse(args.elastic).check(world)
        cfg, change = plan_for_world(cfg, world, local, verbose=os.environ["RANK"] == "0")
        if (warning := shared_store_warning(os.environ)) is not None:
            print(f"hybridpar: warning: {warning}", file=sys.stderr)
    elif cfg.parallel.auto:  # every rank plans the same layout; rank 0 says why
        from hybridpar.planner.front.auto import auto_config

        cfg = auto_config(cfg, world, local, verbose=os.environ["RANK"] == "0")
    resume = _preflight(cfg, world, args.resume)
    # a torchrun restart after a lost rank continues from the newest complete checkpoint; an
    # elastic job always does (a node joining restarts the workers without counting a restart)
    auto = change is not None or (cfg.train.auto_resume and restart_count() > 0)
    return _run_worker(cfg, resume, auto_resume=auto, elastic=change)


def _launch_elastic(cfg: Config, args: argparse.Namespace, argv: list[str]) -> int:
    """``hybridpar train --elastic MIN:MAX [--nproc N] [--rdzv-endpoint HOST:PORT]``: this node's
    launcher of an elastic job (torch's elastic agent, c10d rendezvous). Every world size the
    nodes can form is planned here first, so a job that could never run is refused before launch."""
    from hybridpar.training.elastic import (
        WorldRange,
        default_rdzv_id,
        elastic_nodes,
        parse_rdzv_conf,
        plan_for_world,
    )

    span = WorldRange.parse(args.elastic)
    nproc = args.nproc if args.nproc is not None else span.max
    nodes = elastic_nodes(span, nproc, multi_node=args.rdzv_endpoint is not None)
    for n in range(nodes[0], nodes[1] + 1):
        planned, _ = plan_for_world(cfg, n * nproc, nproc)
        _preflight(planned, n * nproc, args.resume, local=nproc)
        from hybridpar.training.checkpoint.snapshot import check_budget

        check_budget(planned, nproc, multi_node=n > 1)
    if args.max_restarts is not None and args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts} must be >= 0")
    from hybridpar.distributed.launch import Rendezvous, launch_local, strip_launcher_options

    run_dir = Path(cfg.train.run_dir)
    rdzv = Rendezvous(nodes[0], nodes[1], args.rdzv_endpoint or "localhost:0",
                      args.rdzv_id or default_rdzv_id(run_dir, args.rdzv_endpoint), parse_rdzv_conf(args.rdzv_conf))
    worlds = f"{nodes[0] * nproc}" if nodes[0] == nodes[1] else f"{nodes[0] * nproc} to {nodes[1] * nproc}"
    print(f"hybridpar: elastic job of {worlds} processes: {nproc} on this node"
          + (f", rendezvous at {args.rdzv_endpoint} (job {rdzv.run_id})" if args.rdzv_endpoint else ""), flush=True)
    restarts = args.max_restarts if args.max_restarts is not None else ELASTIC_RESTARTS
    return launch_local(nproc, ["train", *strip_launcher_options(argv)], max_restarts=restarts, run_dir=run_dir,
                        command=["hybridpar", "train", *argv], rendezvous=rdzv)


ELASTIC_RESTARTS = 3  # restarts after failures (a lost node counts one) when --elastic has no --max-restarts


def _hf_model(path: str) -> ModelConfig:
    """The model (family and shape) of a Hugging Face directory given as ``train.init_from``."""
    from hybridpar.models.hf import model_config_from_hf

    return model_config_from_hf(path)


def _preflight(cfg: Config, world_size: int, resume: str | None, local: int | None = None) -> Path | None:
    """Every check that needs no process group: layout for this world size, the data, the
    checkpoint to resume. (``train.init_from``'s model already comes from its ``config.json``:
    ``load_config`` read it.) ``local``: the processes on this node when a launcher here starts
    only some of the world (default: all, or the launcher's). Returns the checkpoint path to resume from."""
    validate(cfg, world_size=world_size)
    from hybridpar.training.rundir import check_writable

    check_writable(Path(cfg.train.run_dir))
    from hybridpar.distributed.device import local_world_size, resolve_device_type

    resolve_device_type(cfg.train.device, local or (local_world_size() if under_launcher() else world_size))
    from hybridpar.distributed.lifecycle import says_job_notices

    for warning in config_warnings(cfg) if says_job_notices() else ():
        print(f"hybridpar: warning: {warning}", file=sys.stderr)
    from hybridpar.data.dataset import check_documents, check_seq_len, check_tokenizer, read_meta
    from hybridpar.data.errors import check_vocab
    from hybridpar.data.mixture import check_one_tokenizer, parse_mixture

    metas = []
    for part in parse_mixture(cfg.train.data):  # one dataset, or each of a mixture's
        if part.path != "builtin":
            meta = read_meta(Path(part.path))
            check_vocab(meta.get("vocab_size", 0), cfg.model.vocab_size)
            check_seq_len(meta, cfg.train.seq_len, part.path)
            check_tokenizer(meta, part.path, cfg.train.init_from)
            if cfg.train.document_mask:
                check_documents(meta, part.path)
            metas.append((part.path, meta))
    if len(metas) > 1:
        check_one_tokenizer(metas)
    if resume is None:
        return None
    from hybridpar.training.checkpoint import resolve_resume

    return resolve_resume(resume, Path(cfg.train.run_dir))


def _checkpoint_step(path: Path) -> int:
    from hybridpar.training.checkpoint import read_info, snapshot

    return snapshot.step_of(path) if snapshot.is_snapshot(path) else int(read_info(path)["step"])


def _snapshot_layout(cfg: Config) -> str | None:
    """This job's layout when it takes in-memory snapshots (a restart looks for them), else None."""
    from hybridpar.training.checkpoint import snapshot
    from hybridpar.training.elastic import layout_name

    return layout_name(cfg.parallel) if snapshot.snapshot_every(cfg, snapshot.store_dir() is not None) else None


def _run_worker(cfg: Config, resume: Path | None = None, auto_resume: bool = False,
                elastic: LayoutChange | None = None) -> int:
    """Train in this process (one rank of a launched job, or the whole run). Returns the exit
    status: 0 done, 128 + N stopped by signal N after a complete checkpoint; a user error is
    raised, or (under the local launcher) reported to it and answered with its status.
    ``elastic``: the layout an elastic job planned for this world (recorded in the run)."""
    from hybridpar.distributed import flight, lifecycle
    from hybridpar.distributed.mesh import ParallelDims, destroy_distributed
    from hybridpar.training.checkpoint.snapshot_peers import agree_store
    from hybridpar.training.elastic import agreed_latest_checkpoint, check_same_plan

    device = _start_worker(cfg)
    run_dir = Path(cfg.train.run_dir)
    rank = int(os.environ.get("RANK", "0")) if under_launcher() else 0
    topo = None
    clean = False
    with lifecycle.StopRequest().installed() as stop:
        try:
            if elastic is not None and elastic.world > 1:  # ranks planned alone: agree before the mesh
                check_same_plan(cfg, elastic.world, device.type)
            topo = ParallelDims.from_config(cfg.parallel).build(device.type)
            agree_store(topo)  # in-memory snapshots on every rank or on none
            if topo.world_size > 1:  # a rank signalled while stuck in a collective leaves a record
                counter = topo.comm.counter
                stop.on_signal = lambda sig: flight.dump(counter, run_dir, rank,
                                                        f"signal {lifecycle.signal_name(sig)} received")
            if auto_resume:
                resume = agreed_latest_checkpoint(topo, run_dir, resume, elastic, restart_count(), _snapshot_layout(cfg))
                if resume is not None and _checkpoint_step(resume) >= cfg.train.steps:  # died after the end
                    if topo.rank == 0:
                        print(f"hybridpar: restarted, but {resume} already holds the final step "
                              f"{cfg.train.steps}: nothing left to train", flush=True)
                    clean = True
                    return 0
            status = _fit(cfg, topo, device, stop, elastic, resume)
            clean = True
            return status
        except (UserError, NonFiniteLossError) as e:
            kind = "error" if isinstance(e, UserError) else "stopped"
            if lifecycle.report_error(rank, kind, str(e), getattr(e, "agreed", 0)):
                return 2 if kind == "error" else 3
            raise
        except Exception as e:  # e.g. a collective that timed out: leave a flight record
            if topo is not None and topo.world_size > 1 and _after_failure(e, topo, run_dir, rank, stop, elastic):
                return 1
            raise
        finally:
            _teardown(topo, orderly=clean)
            destroy_distributed()


def _start_worker(cfg: Config) -> torch.device:
    """This worker process's device and default process group. On CPU the trainer also keeps
    the heap a step frees for the next step (a process-wide malloc setting the library API
    leaves to its user: :func:`hybridpar.distributed.device.keep_host_heap`)."""
    from hybridpar.distributed import device as devices
    from hybridpar.distributed import lifecycle
    from hybridpar.distributed.mesh import backend_for, init_distributed

    if under_launcher():
        lifecycle.die_with_parent()
    device = devices.pick_device(cfg.train.device, devices.local_rank())
    if device.type == "cpu":
        devices.keep_host_heap()
    init_distributed(backend=backend_for(device.type), timeout_s=cfg.train.timeout_s)
    return device


def _fit(cfg: Config, topo: Topology, device: torch.device, stop: StopRequest, elastic: LayoutChange | None,
         resume: Path | None) -> int:
    """Train to the end (0), or until a signal stopped the run after a complete checkpoint
    (128 + N, with how to resume or, under an elastic agent, that it restarts the job)."""
    from hybridpar.distributed import lifecycle
    from hybridpar.training.rundir import hold_run_dir
    from hybridpar.training.trainer import Trainer

    try:  # rank 0 owns the run directory (unless this job's launcher holds it already)
        with hold_run_dir(Path(cfg.train.run_dir)) if topo.rank == 0 else contextlib.nullcontext():
            Trainer(cfg, topo, device, stop=stop, elastic=elastic).fit(resume)
    except lifecycle.Preempted as p:
        if topo.rank == 0 and elastic is not None:  # e.g. a node joined: the agent restarts the job
            print(f"hybridpar: elastic: {p}; the launcher restarts the job", file=sys.stderr, flush=True)
        elif topo.rank == 0:
            print(f"hybridpar: {p}\nhybridpar: resume with: {lifecycle.resume_command(p.checkpoint)}",
                  file=sys.stderr, flush=True)
            lifecycle.note_stop_said()
        return 128 + p.signum
    return 0


def _after_failure(e: Exception, topo: Topology, run_dir: Path, rank: int, stop: StopRequest,
                   elastic: LayoutChange | None) -> bool:
    """A multi-rank job failed with ``e``: leave a flight record; True when this rank's failure
    is expected (a consequence of another's, or a lost peer the launcher restarts or reports) and was
    told in one line, False when ``e`` should propagate after the record's summary."""
    from hybridpar.distributed import flight, lifecycle
    from hybridpar.training.elastic import peer_lost

    flight.dump(topo.comm.counter, run_dir, topo.rank, f"{type(e).__name__}: {e}")
    if stop.signum or lifecycle.reported_elsewhere(rank):  # a consequence, not the cause
        print(f"hybridpar: rank {rank} stopped (another rank failed or the job was signalled)",
              file=sys.stderr, flush=True)
        return True
    if under_launcher() and (lost := peer_lost(e)):  # a rank died: one line, no traceback
        if (said := lifecycle.lost_peer_line(rank, lost, elastic is not None)) is not None:
            print(said, file=sys.stderr, flush=True)
        return True
    print(f"hybridpar: rank {topo.rank} {flight.describe(flight.records(topo.comm.counter))}", file=sys.stderr)
    return False


def _teardown(topo: Topology | None, orderly: bool) -> None:
    """Release the job's process groups. After a clean finish every rank first waits for the
    others (a rank that leaves early would cut a peer's last collective), then the groups are
    destroyed so no gloo thread holds a tensor when the process exits."""
    if topo is None:
        return
    if orderly and topo.world_size > 1:
        with contextlib.suppress(Exception):
            topo.comm.barrier()
    topo.close()


def cmd_convert(argv: list[str]) -> int:
    from hybridpar.training.convert import (
        cmd_convert as convert,  # torch/safetensors only when used
    )

    return convert(argv)


def cmd_prepare(argv: list[str]) -> int:
    from hybridpar.data.prepare import cmd_prepare as prepare

    return prepare(argv)


def cmd_generate(argv: list[str]) -> int:
    from hybridpar.training.generate import cmd_generate as generate

    return generate(argv)


def cmd_timeline(argv: list[str]) -> int:
    from hybridpar.parallel.pipeline.timeline import cmd_timeline as timeline

    return timeline(argv)


def cmd_plan(argv: list[str]) -> int:
    from hybridpar.planner.front.cli import cmd_plan as plan

    if any(a == "--dry-run" or a.startswith("--dry-run=") for a in argv):  # the trainer (torch) only when asked
        from hybridpar.training.dryrun_plan import check_layouts

        return plan(argv, check_layouts)
    return plan(argv)


def cmd_calibrate(argv: list[str]) -> int:
    from hybridpar.planner.front.calibrate_cli import cmd_calibrate as calibrate

    return calibrate(argv)


def cmd_compare(argv: list[str]) -> int:
    from hybridpar.training.compare import cmd_compare as compare

    return compare(argv)


COMMANDS = {
    "train": (cmd_train, "train a model"),
    "prepare": (cmd_prepare, "tokenize text files into a dataset for --train.data"),
    "generate": (cmd_generate, "sample text from a checkpoint"),
    "compare": (cmd_compare, "are two runs' losses and weights equal to floating-point tolerance?"),
    "convert": (cmd_convert, "export a checkpoint as Hugging Face weights"),
    "timeline": (cmd_timeline, "draw a pipeline schedule's per-rank timeline as a PNG"),
    "plan": (cmd_plan, "predict memory and step time of layouts and rank them"),
    "calibrate": (cmd_calibrate, "measure this machine's matmul and collective rates into a hardware profile"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "--version"):  # bare `hybridpar`: the commands, not a run
        from hybridpar.cli_text import top_level

        print(top_level(argv, {name: what for name, (_, what) in COMMANDS.items()}))
        return 0
    if argv[0] not in COMMANDS:
        print(f"hybridpar: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[argv[0]][0](argv[1:])
    except UserError as e:
        print(f"hybridpar: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLossError as e:
        print(f"hybridpar: stopped: {e}", file=sys.stderr)
        return 3


def entry() -> NoReturn:
    """``hybridpar`` and ``python -m hybridpar.cli``. A launched worker leaves through
    :func:`hybridpar.distributed.lifecycle.exit_process` (no interpreter finalization, which can
    abort while gloo's threads free their last tensors); its groups are gone by then.

    OpenMP's threads wait passively unless the user chose (``OMP_WAIT_POLICY``; read when torch
    loads, which this module has not done yet): spinning threads made a CPU step ~50-400x slower
    whenever another process held a core (issue 44: the tiny FP8 step 0.30 -> 14.7 s, fp32
    0.013 -> 5.2 s at 2 threads on a busy 2-core machine). Launched workers inherit it."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if not under_launcher():
        sys.exit(main())
    from hybridpar.distributed.lifecycle import exit_process

    try:
        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    exit_process(code)


if __name__ == "__main__":
    entry()
