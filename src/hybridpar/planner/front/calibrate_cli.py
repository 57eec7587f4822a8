"""``hybridpar calibrate``: measure this machine (:mod:`hybridpar.planner.machine.calibrate`) or fit
a profile to runs (:mod:`hybridpar.planner.front.fit`). Apart from ``hybridpar plan``
(:mod:`hybridpar.planner.front.cli`), which imports no torch and so answers faster.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridpar.distributed import device as devices
from hybridpar.planner.front.fit import from_run, write_profile
from hybridpar.planner.machine.calibrate import calibrate
from hybridpar.planner.machine.profile import default_profile_path, usable_cores


def cmd_calibrate(argv: list[str]) -> int:
    """``hybridpar calibrate [--quick] [--out FILE] [--nproc N] [--device D] [--from-run DIR]``."""
    p = argparse.ArgumentParser(prog="hybridpar calibrate",
                                description="Measure matmul, attention, memory and collective rates of this "
                                            "machine and write a hardware profile for plan and train.")
    p.add_argument("--out", default=None, help=f"profile path (default {default_profile_path()})")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes for the collectives: axis sizes 2, 4, ... up to N are measured "
                        "(default: CPU cores, or GPUs)")
    p.add_argument("--quick", action="store_true", help="smaller grids and shorter timings (well under a minute)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--from-run", metavar="DIR", action="append",
                   help="instead of measuring: fit the planner's efficiency terms to a hybridpar train run "
                        "(repeatable) and write that profile (hybridpar.planner.front.fit)")
    p.add_argument("--gpu", default=None, help="with --from-run: the device model to fit from (default: the run's)")
    args = p.parse_args(argv)
    if args.from_run:
        args.model = args.gpus = args.global_batch = args.seq_len = None
        fitted = from_run(args)
        print("\n".join(fitted.lines()))
        out = write_profile(fitted, Path(args.out) if args.out else default_profile_path())
        print(f"wrote {out}")
        return 0
    cuda = devices.prefers_gpu(args.device)
    nproc = args.nproc if args.nproc is not None else (
        devices.accelerator_count() if cuda else max(2, usable_cores()))
    out = Path(args.out) if args.out else default_profile_path()
    calibrate(out, nproc, args.quick, args.device, progress=lambda s: print(s, flush=True))
    return 0
