"""OpenMP threads wait passively in hybridpar's processes (issue 44, point 11): spinning
threads made a CPU step 50-400x slower whenever another process held a core (the tiny FP8 step
0.30 -> 14.7 s, fp32 0.013 -> 5.2 s, 2 threads on a busy 2-core machine). The policy must be in
the environment before torch loads, so the command sets it first thing; a user's own choice stays."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CODE = textwrap.dedent("""
    import os, sys
    sys.argv = ["hybridpar", "--version"]
    from hybridpar import cli
    try:
        cli.entry()
    except SystemExit:
        pass
    print("policy", os.environ.get("OMP_WAIT_POLICY"), "torch loaded before:", "torch" in sys.modules)
""")


def _run(env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_the_command_sets_passive_waiting_before_torch_loads_and_keeps_a_users_choice():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert "policy PASSIVE torch loaded before: False" in _run(env)
    assert "policy ACTIVE" in _run({**env, "OMP_WAIT_POLICY": "ACTIVE"})
