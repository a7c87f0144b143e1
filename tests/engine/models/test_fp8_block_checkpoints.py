"""Block-scaled FP8 checkpoints (quantization_config quant_method "fp8" + weight_block_size, as
DeepSeek-V3 and Qwen3-FP8 ship them): the FP8 values are read as stored and dequantized with their
`weight_scale_inv` blocks at load, so the model computes exactly what its dequantized twin (written
dense by the test's own arithmetic) computes; a misshapen scale is one line naming it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.loader import load_checkpoint
from engine.models.weights import CheckpointMismatchError
from tests.engine.models._deepseek_v3 import DeepseekCheckpoint
from tests.engine.models._fp8_blocks import (
    BLOCK,  # noqa: F401 (tests/engine/parallel/test_tensor_parallel.py imports it from here)
    FP8,
    quantize_blocks,  # noqa: F401 (likewise)
    write_fp8_checkpoint,
)
from tests.engine.models._greedy import greedy, make_runner

QUANTIZED = ("_proj.weight", "_proj_with_mqa.weight")  # attention and MLP projections, not gates


@pytest.fixture(scope="module")
def fp8_and_twin(deepseek_v3_checkpoints: dict[str, DeepseekCheckpoint],
                 tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_fp8_checkpoint(
        deepseek_v3_checkpoints["lora"].directory, tmp_path_factory.mktemp("fp8_blocks"),
        lambda name, _: name.endswith(QUANTIZED) and not name.startswith("model.layers.3."))


def test_a_block_scaled_fp8_checkpoint_computes_what_its_dequantized_twin_does(
        fp8_and_twin: tuple[Path, Path]) -> None:
    fp8_dir, twin_dir = fp8_and_twin
    with safe_open(str(fp8_dir / "model.safetensors"), framework="pt") as f:
        name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"  # [40, 64]: a partial row block
        assert f.get_tensor(name).dtype == FP8 and f.get_tensor(name + "_scale_inv").shape == (3, 4)
    fp8, twin = (load_checkpoint(str(fp8_dir), progress=False),
                 load_checkpoint(str(twin_dir), progress=False))
    assert not any(n.endswith("_scale_inv") for n in fp8.weights)
    for name, tensor in twin.weights.items():
        assert torch.equal(fp8.weights[name], tensor), name
    prompts = [[5, 17, 99, 3, 250, 42, 7, 8] * 3, [1, 2, 3, 4, 200]]
    ours, our_logits = greedy(make_runner(fp8.config, fp8.weights), prompts, 5)
    theirs, their_logits = greedy(make_runner(twin.config, twin.weights), prompts, 5)
    assert ours == theirs
    for a, b in zip(our_logits, their_logits, strict=True):
        assert torch.equal(a, b)


def test_a_misshapen_block_scale_is_one_error_naming_it(fp8_and_twin: tuple[Path, Path],
                                                        tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(fp8_and_twin[0], broken)
    tensors = load_file(str(broken / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatchError,
                       match=r"'model\.layers\.0\.mlp\.down_proj\.weight_scale_inv'"):
        load_checkpoint(str(broken), progress=False)
