"""How long `hybridpar plan`'s layout search takes (CPU seconds), for the planner's big cases.

llama3-70b on 64 H100 and llama3-405b on 1024 (global batch 512, 8192 tokens), top 5: the
search should answer in about a second (target <= 5 s of CPU each, on a shared 2-core machine).
Moved here from the tests, which hold no timings.

    python benchmarks/planner_search.py
"""

from __future__ import annotations

import json
import time

from hybridpar.config import model_preset
from hybridpar.planner.machine.hardware import GPUS, Cluster
from hybridpar.planner.model.layout import Workload
from hybridpar.planner.search.search import search

CASES = (("llama3-70b", 64), ("llama3-405b", 1024))
TARGET_S = 5.0


def main() -> None:
    rows = []
    for name, gpus in CASES:
        start = time.process_time()
        result = search(model_preset(name), Workload(512, 8192), Cluster.of(GPUS["H100-SXM"], gpus, 8), top=5)
        rows.append({"model": name, "gpus": gpus, "cpu_s": round(time.process_time() - start, 3),
                     "ranked": len(result.ranked)})
    print(f"{'model':<14}{'gpus':>6}{'search CPU s':>14}{'ranked':>8}")
    for r in rows:
        print(f"{r['model']:<14}{r['gpus']:>6}{r['cpu_s']:>14.3f}{r['ranked']:>8}")
    ok = all(r["cpu_s"] <= TARGET_S for r in rows)
    print(f"target <= {TARGET_S} s each: {'PASS' if ok else 'MISS'}")
    print(json.dumps({"benchmark": "planner_search", "rows": rows, "target_s": TARGET_S, "pass": ok}))


if __name__ == "__main__":
    main()
