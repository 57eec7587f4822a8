"""FP8's refusals (rules ``train-fp8-*``, docs/reference/errors.md) and the build step that applies the recipe."""

from __future__ import annotations

import pytest
import torch
from layouts import make_config, trainer_for

from hybridpar.config import ConfigError, load_config
from hybridpar.errors import UserError
from hybridpar.parallel.fp8 import Fp8Linear
from hybridpar.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from hybridpar.rules import fp8_device_error
from hybridpar.training.features.fp8 import Fp8Component, apply_fp8


@pytest.mark.parametrize("flags, message", [
    (["--fp8.recipe", "e4m3"], "fp8.recipe = 'e4m3' is not an FP8 recipe"),
    (["--fp8.recipe", "tensorwise", "--train.precision", "fp16"], "fp8.recipe with train.precision = 'fp16'"),
    (["--fp8.recipe", "rowwise", "--model.ffn_hidden", "392"], "model.ffn_hidden / tp = 392 is not a multiple of 16"),
    (["--fp8.recipe", "rowwise", "--parallel.cp", "2", "--train.seq_len", "24", "--train.micro_batch", "1",
      "--train.global_batch", "8"], "(tokens) = 12 is not a multiple of 16"),
])
def test_refused_before_launch(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        load_config(None, flags)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_bf16_and_fp32_with_fp8_are_accepted() -> None:
    for precision in ("bf16", "fp32"):
        assert load_config(None, ["--fp8.recipe", "rowwise", "--train.precision", precision]).fp8.recipe == "rowwise"


def test_device_without_fp8_kernels_is_refused(tmp_path) -> None:
    cfg = make_config(str(tmp_path), "--model.dim", "64", "--fp8.recipe", "rowwise")
    assert fp8_device_error("rowwise", "cpu", True) is None and fp8_device_error("none", "cuda:0", False) is None
    with (trainer_for(make_config(str(tmp_path), "--model.dim", "64")) as trainer,
          pytest.raises(UserError, match="needs FP8 matmul kernels, which cuda does not have")):
        apply_fp8(cfg, trainer.topo, torch.device("cuda"), [])  # no CUDA here, or one below 8.9


def test_the_blocks_linears_and_nothing_else_run_fp8(tmp_path) -> None:
    with trainer_for(make_config(str(tmp_path), "--model.dim", "64", "--fp8.recipe", "tensorwise")) as trainer:
        model = trainer.engine.model
        fp8 = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
        assert trainer.hooks.find(Fp8Component).linears == len(fp8) == 7 * 2  # wq wk wv wo w1 w2 w3, 2 layers
        assert all(n.startswith("layers.") for n in fp8)
        assert not isinstance(model.output, Fp8Linear)
        assert trainer.hooks.summary()["fp8"] == {"recipe": "tensorwise", "linear_layers": 14}
        assert all(p.dtype == torch.float32 for p in model.parameters())


def test_tp_linears_get_their_axes(tmp_path) -> None:
    cfg = make_config(str(tmp_path), "--model.dim", "64", "--fp8.recipe", "rowwise")
    with trainer_for(make_config(str(tmp_path), "--model.dim", "64")) as trainer:
        col = ColumnParallelLinear(64, 32, trainer.topo.tp)
        row = RowParallelLinear(32, 64, trainer.topo.tp)
        assert apply_fp8(cfg, trainer.topo, torch.device("cpu"), [torch.nn.ModuleList([col, row])]) == 2
        assert col.fp8.out_axes == (trainer.topo.tp,) and col.fp8.in_axes == ()
        assert row.fp8.in_axes == (trainer.topo.tp,) and row.fp8.out_axes == ()
