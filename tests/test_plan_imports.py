"""``hybridpar plan`` does not pay for torch (about 1.4 s to import), its compiler or the run's tools
(issue 44, point 18): the planner's path is pure Python. The collectives' graph breaks are applied
when the first Comm is made, not when comm.py is imported, and they are in place before anything
can be compiled."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_plan_imports_no_dynamo_and_a_comm_still_breaks_graphs():
    code = textwrap.dedent("""
        import sys
        from hybridpar.cli import main
        assert main(["plan", "--model", "tiny", "--gpus", "2", "--global-batch", "8", "--seq-len", "64",
                     "--top", "1"]) == 0
        print("dynamo after plan:", "torch._dynamo" in sys.modules)
        heavy = ("torch", "torch._inductor", "transformers", "huggingface_hub", "safetensors", "matplotlib", "tensorboard",
                 "torch.utils.tensorboard", "sympy")
        print("heavy after plan:", [m for m in heavy if m in sys.modules])
        from hybridpar.distributed.comm import Comm
        Comm()
        print("all_reduce disabled for dynamo:", getattr(Comm.all_reduce, "_torchdynamo_disable", False))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dynamo after plan: False" in proc.stdout, proc.stdout[-2000:]
    # nor torch itself, the compiler's backend, Hugging Face's readers, plotting or TensorBoard (the run's
    # tools): `plan` needs none of them (point 18; the check counts modules, not seconds)
    assert "heavy after plan: []" in proc.stdout, proc.stdout[-2000:]
    assert "all_reduce disabled for dynamo: True" in proc.stdout
