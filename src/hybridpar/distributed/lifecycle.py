"""A training process's life: it dies with its launcher, stops cleanly on a signal, reports a user
error once, and exits without running interpreter finalizers that race gloo's threads.

Why each piece exists:

* **die_with_parent.** torchrun starts every worker in a session of its own, so a signal to the
  launcher's process group never reaches them, and a SIGKILLed launcher used to leave them training
  unattended. The kernel's parent-death signal ties their life to the launcher's.
* **StopRequest.** Cluster schedulers preempt with SIGTERM, users press Ctrl-C. The first signal
  only sets a flag; at the next step boundary the ranks agree (one max-all-reduce of the signal
  number) so every rank stops after the same step, saves a complete checkpoint and exits
  ``128 + signal``. A second signal aborts at once: a checkpoint being written then has no
  ``complete.json`` and is never picked by ``--resume``.
* **ErrorReport.** A user error raised in a worker (a corrupt checkpoint, a short data split) is
  written to a file the local launcher reads; it prints the line once and exits 2 instead of
  every rank printing it followed by the launcher's traceback.
* **exit_process.** At interpreter shutdown a gloo worker thread may drop the last reference to a
  finished collective whose tensor needs the GIL to free; during finalization that thread is
  killed by ``pthread_exit`` inside a noexcept frame and the process aborts (``terminate called
  without an active exception``; about 1 run in 5 of the 8-process demo). After an orderly
  teardown (final barrier, every group destroyed) the process leaves with ``os._exit``, which runs
  no finalizers, once its output is flushed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

import torch

if TYPE_CHECKING:
    from hybridpar.distributed.mesh import Axis

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
ERROR_DIR_ENV = "HYBRIDPAR_ERROR_DIR"  # set by the local launcher: where workers leave user errors
COMMAND_ENV = "HYBRIDPAR_COMMAND"  # set by the local launcher: the user's command, for resume hints
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent (the launcher) dies; exit at
    once if the parent is already gone. Linux only; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent == 1 or os.getppid() != parent:  # orphaned before the request took effect
        os._exit(128 + int(sig))


def signal_name(signum: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(signum).name
    return f"signal {signum}"


class StopRequest:
    """The first SIGTERM / SIGINT / SIGHUP asks training to stop after the current step; a second
    one exits at once with ``128 + signal``."""

    def __init__(self) -> None:
        self.signum = 0  # 0: no stop requested
        #: the host tensor :meth:`agreed` reduces on a CPU (gloo) axis: reading it back never
        #: waits for a device, so the per-step agreement costs no device synchronization
        self.host_flag = torch.zeros(1, dtype=torch.int32)
        self.on_signal: Callable[[int], None] | None = None  # e.g. leave a flight record

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Route the stop signals here (main thread only) and restore the previous handlers on
        leaving: the CLI may run in-process, e.g. under pytest, whose Ctrl-C must come back."""
        saved = [signal.getsignal(sig) for sig in STOP_SIGNALS]
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for sig, handler in zip(STOP_SIGNALS, saved, strict=True):
                signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum:
            os.write(2, f"hybridpar: second {signal_name(signum)}: stopping now; the checkpoint being "
                        "written, if any, stays incomplete and is never resumed from\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        if self.on_signal is not None:
            self.on_signal(signum)

    def request(self, signum: int) -> None:
        """Ask for a stop as a signal would (tests, or code that knows the job must end)."""
        self._handle(signum, None)

    def agreed(self, axis: Axis, device: torch.device) -> int:
        """The signal every rank of ``axis`` agrees to stop for (the largest any rank received),
        or 0 to go on. Collective over ``axis``: call it at the same point on every rank. With a
        CPU ``device`` (a gloo axis, e.g. ``Topology.side_axis``) the flag is :attr:`host_flag`."""
        if axis.size == 1:
            return self.signum
        if device.type == "cpu":
            flag = self.host_flag
            flag.fill_(self.signum)
        else:
            flag = torch.tensor([self.signum], dtype=torch.int32, device=device)
        axis.comm.all_reduce(flag, axis, op="max")
        return int(flag.item())


class Preempted(Exception):  # noqa: N818 (an outcome, not a failure)
    """Training stopped on a signal after ``step``, with a complete checkpoint at ``checkpoint``."""

    def __init__(self, signum: int, step: int, checkpoint: Path) -> None:
        super().__init__(f"stopped by {signal_name(signum)} after step {step}; checkpoint {checkpoint} is complete")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


def resume_command(checkpoint: Path) -> str:
    """The command that continues this run from ``checkpoint``: the user's own command (as the
    local launcher recorded it) with ``--resume CHECKPOINT`` in place of any earlier --resume."""
    import shlex

    recorded = os.environ.get(COMMAND_ENV)
    argv = shlex.split(recorded) if recorded else ["<your torchrun command>", *sys.argv[1:]]
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            if not a.startswith("--"):
                continue
        if a == "--resume":
            skip = True
            continue
        if a.startswith("--resume="):
            continue
        out.append(a)
    return shlex.join([*out, "--resume", str(checkpoint)]) if recorded else \
        " ".join([*out[:1], shlex.join([*out[1:], "--resume", str(checkpoint)])])


# ----------------------------------------------------------------------------- error reports


def report_error(rank: int, kind: str, message: str, agreed: int = 0) -> bool:
    """Leave ``message`` for the local launcher to print once; False without a launcher that
    reads it (the caller prints it itself then). ``agreed``: every rank raised its version
    together (``UserError.agreed``); the launcher prints one of those."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder:
        return False
    path = Path(folder) / f"rank-{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank, "kind": kind, "message": message, "agreed": agreed}))
    os.replace(tmp, path)
    return True


STOP_SAID = "stop-said"  # in the launcher's error folder: rank 0 has told the user why the job stopped


def note_stop_said() -> None:
    """Tell the local launcher (if any) that rank 0 printed the stop on a signal and the resume
    command, so the launcher does not repeat "stopped by SIG..." after them."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if folder:
        with contextlib.suppress(OSError):
            (Path(folder) / STOP_SAID).touch()


def reported_elsewhere(rank: int) -> bool:
    """Another rank has already reported an error: this rank's failure is a consequence."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder or not Path(folder).is_dir():
        return False
    return any(p.name != f"rank-{rank}.json" for p in Path(folder).glob("rank-*.json"))


def read_reports(folder: Path) -> list[dict]:
    """Every rank's report, in rank order."""
    out = []
    for p in sorted(Path(folder).glob("rank-*.json")):
        with contextlib.suppress(OSError, json.JSONDecodeError):
            out.append(json.loads(p.read_text()))
    return sorted(out, key=lambda r: r["rank"])


# ----------------------------------------------------------------------------- exit


_RELEASE_REGISTERED = False


def release_groups_at_exit() -> None:
    """Destroy every process group when the interpreter exits (registered once, by
    :func:`hybridpar.distributed.mesh.init_distributed` when it creates the default group).

    A script of the library's users (a DeepSpeed loop that never calls ``engine.close()``) ends
    with its groups alive; interpreter finalization then races gloo's threads (module docstring,
    ``exit_process``) and a rank aborts with SIGABRT after training finished. ``atexit`` runs
    before finalization, and ``destroy_process_group`` waits for pending work and shuts every
    backend's threads down, so the process leaves with none left running. Local and collective-
    free: a peer that exited first does not block it."""
    global _RELEASE_REGISTERED
    if not _RELEASE_REGISTERED:
        import atexit

        atexit.register(_release_groups)
        _RELEASE_REGISTERED = True


def _release_groups() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """Flush output and leave without interpreter finalization (see the module docstring). Call
    only after the process groups are destroyed and every file the run writes is closed."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def lost_peer_line(rank: int, lost: str, elastic: bool) -> str | None:
    """What rank ``rank`` says when its collective failed because a peer died (``lost``: the
    backend's words), or None where hybridpar's own ``--max-restarts`` launcher says it instead,
    naming the rank it lost and how (one line for the job). An elastic agent restarts on the
    processes left; torchrun's ``--max-restarts`` from the last checkpoint while restarts are left."""
    if elastic:
        return f"hybridpar: rank {rank}: lost a peer ({lost}); the elastic agent restarts the job on the processes left"
    if os.environ.get(ERROR_DIR_ENV):
        return None
    most = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    left = most - int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    then = (f"the launcher restarts the job from its last checkpoint ({left} of --max-restarts {most} left)" if left > 0
            else f"no restarts left (--max-restarts {most}): the job stops")
    return f"hybridpar: rank {rank}: lost a peer ({lost}); {then}"


def says_job_notices() -> bool:
    """Whether this process prints the job's one-time notices (config warnings, skipped
    checkpoints found before training): not a worker of hybridpar's own launcher, which printed
    them before starting its workers, and only rank 0 of another launcher's job."""
    return not os.environ.get(ERROR_DIR_ENV) and os.environ.get("RANK", "0") == "0"
