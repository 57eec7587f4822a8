"""How long `hybridpar plan` takes to answer, start-up and imports included (issue 44, point 18;
issue 43 for DeepSeek-V3), for the planner's big cases.

Each case runs `python -m hybridpar plan ... --json` in a fresh process ``--repeat`` times
(default 3) and reports the wall-clock seconds and the CPU seconds (user + sys of the child,
less sensitive to other load on the machine), min and median. Targets: 3 s wall for
Llama-3.1-8B on 8 H100 and 70B on 64 (point 18), 10 s for DeepSeek-V3 on 2,048 H800 (issue 43:
"in seconds"; it exits 1, no layout its trainer runs fits, and the time still counts).
The timings depend on the machine and its load: state both (``uptime``) with the numbers.
DeepSeek-V3/2048 on the shared 2-core machine, CPU min / median: 70.0 / 78.4 s (load 1-2) before
the lazy runtime notes and the span memo, 55.8 / 57.4 s (load 1) after (``docs/howto/deepseek-v3.md``).
Moved here from the tests, which hold no timings.

    python benchmarks/planner_search.py [--repeat N] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

# (name, plan arguments, target wall seconds)
CASES = (
    ("llama3-8b/8", "--model llama3-8b --gpus 8 --global-batch 64 --seq-len 4096", 3.0),
    ("llama3-70b/64", "--model llama3-70b --gpu H100-SXM --gpus 64 --global-batch 512 --seq-len 8192", 3.0),
    ("llama3-405b/1024", "--model llama3-405b --gpus 1024 --global-batch 512 --seq-len 8192", None),
    ("deepseek-v3/2048", "--model deepseek-v3 --gpus 2048 --gpu H800 --global-batch 15360 --seq-len 4096", 10.0),
)


def run_once(args: str) -> tuple[float, float, int]:
    """(wall s, CPU s of the child, exit status) of one ``hybridpar plan`` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hybridpar", "plan", *args.split(), "--json"],
                          capture_output=True, text=True, env=os.environ.copy())
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.returncode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--only", nargs="*", default=None, help="case names to run (default all)")
    opts = p.parse_args()
    rows = []
    for name, args, target in CASES:
        if opts.only and name not in opts.only:
            continue
        runs = [run_once(args) for _ in range(opts.repeat)]
        walls, cpus = [r[0] for r in runs], [r[1] for r in runs]
        rows.append({"case": name, "wall_min_s": round(min(walls), 2), "wall_median_s": round(statistics.median(walls), 2),
                     "cpu_min_s": round(min(cpus), 2), "cpu_median_s": round(statistics.median(cpus), 2),
                     "exit": runs[0][2], "target_s": target,
                     "pass": None if target is None else min(walls) <= target})
    load = os.getloadavg()[0]
    print(f"{'case':<18}{'wall min':>10}{'median':>8}{'CPU min':>9}{'median':>8}{'exit':>6}{'target':>8}")
    for r in rows:
        target = "" if r["target_s"] is None else f"{r['target_s']:.0f} s " + ("PASS" if r["pass"] else "MISS")
        print(f"{r['case']:<18}{r['wall_min_s']:>10.2f}{r['wall_median_s']:>8.2f}{r['cpu_min_s']:>9.2f}"
              f"{r['cpu_median_s']:>8.2f}{r['exit']:>6}  {target}")
    print(f"load average (1 min) at the end: {load:.2f}, {os.cpu_count()} CPUs, {opts.repeat} runs each")
    print(json.dumps({"benchmark": "planner_search", "rows": rows, "repeat": opts.repeat, "load_1min": load}))


if __name__ == "__main__":
    main()
