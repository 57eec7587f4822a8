"""A rank that skips a collective ends the job within train.timeout_s, with a per-rank report."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from test_cli import TINY

from hybridpar.distributed import flight

SCRIPT = textwrap.dedent("""
    import os, sys
    from hybridpar.training.trainer import Trainer
    from hybridpar.cli import main

    real = Trainer.train_step

    def train_step(self, step):
        if step == 2 and self.topo.rank == 1:  # this rank skips step 2's collectives entirely
            import time
            deadline = time.monotonic() + 60
            while not self.stop.signum and time.monotonic() < deadline:
                time.sleep(0.05)
            # the launcher's SIGTERM (rank 0 failed) left this rank's flight record; end here as
            # its SIGKILL would, instead of sitting out torchrun's 30 s grace period
            os._exit(128 + self.stop.signum if self.stop.signum else 1)
        return real(self, step)

    Trainer.train_step = train_step
    sys.exit(main(sys.argv[1:]))
""")


def test_skipped_collective_times_out_with_a_flight_report(tmp_path):
    script = tmp_path / "faulty.py"
    script.write_text(SCRIPT)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
           "train", *TINY, "--parallel.dp", "2", "--train.timeout_s", "4", "--train.run_dir", str(run)]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    text = flight.report(run)
    assert text is not None, proc.stderr[-2000:]
    lines = {int(line.split()[1].rstrip(":")): line for line in text.splitlines()[1:]}
    # rank 0 finished step 1 and waits in step 2's first gradient all-reduce on dp
    assert "waiting in all_reduce/dp" in lines[0] and "timed out" in lines[0].lower()
    # rank 1 never entered step 2: its last op on the training's groups is step 1's finished loss
    # average (a 4-byte all-reduce over dp; the end-of-step stop agreement runs on a gloo side
    # group of its own, off the device, so the flight record does not list it), and the
    # launcher's SIGTERM (after rank 0 failed) is why it stopped
    assert "last finished all_reduce/dp" in lines[1] and "(4 B)" in lines[1] and "signal" in lines[1]
    assert "hybridpar: rank 0 waiting in all_reduce/dp" in proc.stderr
