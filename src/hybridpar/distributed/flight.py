"""Hang reports from the comm layer's flight recorder.

When a rank fails (a collective timed out, an exception, a SIGTERM from the launcher because a
peer died), it writes the last operations it entered to ``<run_dir>/flight/rank-N.json``. The
launching process then prints one line per rank, so "rank 1 is in all_reduce/dp #12, rank 0
went on to barrier/world #13" is visible instead of a bare timeout.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hybridpar.distributed.comm import CommCounter

FLIGHT_DIR = "flight"


def records(counter: CommCounter) -> list[dict]:
    """The flight recorder as plain dicts, oldest first."""
    return [{"seq": r.seq, "op": str(r.op), "axis": r.axis, "bytes": r.nbytes, "peer": r.peer, "done": r.done}
            for r in counter.recent()]


def dump(counter: CommCounter, run_dir: Path, rank: int, reason: str) -> Path | None:
    """Write this rank's recent ops and the reason it stopped (atomically). A run directory that
    cannot be made or written loses the record, not the failure's own report: None then."""
    folder = Path(run_dir) / FLIGHT_DIR
    ops = records(counter)
    path = folder / f"rank-{rank}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"rank": rank, "reason": reason, "time": time.time(), "ops": ops}, indent=1))
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def clear(run_dir: Path) -> None:
    """Remove reports of an earlier run so a new report never mixes runs."""
    folder = Path(run_dir) / FLIGHT_DIR
    if folder.is_dir():
        for f in folder.glob("rank-*.json"):
            f.unlink(missing_ok=True)


def describe(ops: list[dict]) -> str:
    """'in all_reduce/dp #12 (4 B)' for the first unfinished op, else the last one entered."""
    if not ops:
        return "entered no collective yet"
    pending = [o for o in ops if not o["done"]]
    o = pending[0] if pending else ops[-1]
    peer = f" with rank {o['peer']}" if o["peer"] is not None else ""
    state = "waiting in" if not o["done"] else "last finished"
    return f"{state} {o['op']}/{o['axis']} #{o['seq']}{peer} ({o['bytes']} B)"


def report(run_dir: Path) -> str | None:
    """One line per rank that left a flight record, or None when there are none."""
    folder = Path(run_dir) / FLIGHT_DIR
    files = sorted(folder.glob("rank-*.json"), key=lambda p: int(p.stem.split("-")[1])) if folder.is_dir() else []
    if not files:
        return None
    lines = ["hang report (last collective or p2p each rank entered):"]
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        reason = data["reason"].splitlines()[0][:160] if data["reason"] else ""
        lines.append(f"  rank {data['rank']}: {describe(data['ops'])}; stopped by: {reason}")
    return "\n".join(lines)
