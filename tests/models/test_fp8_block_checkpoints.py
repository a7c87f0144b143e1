"""Block-scaled FP8 checkpoints (quantization_config quant_method "fp8" + weight_block_size, as
DeepSeek-V3 and Qwen3-FP8 ship them): the FP8 values are read as stored and dequantized with their
`weight_scale_inv` blocks at load, so the model computes exactly what its dequantized twin (written
dense by the test's own arithmetic) computes; a misshapen scale is one line naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.loader import load_checkpoint
from engine.models.weights import CheckpointMismatchError
from tests.models._deepseek_v3 import DeepseekCheckpoint
from tests.models._greedy import greedy, make_runner

BLOCK = (16, 16)  # the released files use [128, 128]; 16 gives the tiny model partial blocks too
FP8 = torch.float8_e4m3fn
QUANTIZED = ("_proj.weight", "_proj_with_mqa.weight")  # attention and MLP projections, not gates


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (fp8 [N, K], scale_inv float32 [ceil(N/Bn), ceil(K/Bk)]) by block amax."""
    n, k = weight.shape
    rows, cols = -(-n // BLOCK[0]), -(-k // BLOCK[1])
    padded = torch.zeros(rows * BLOCK[0], cols * BLOCK[1])
    padded[:n, :k] = weight
    blocks = padded.view(rows, BLOCK[0], cols, BLOCK[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(FP8).max  # [rows, cols]
    quantized = (blocks / scale[:, None, :, None]).view(rows * BLOCK[0], cols * BLOCK[1])
    return quantized[:n, :k].to(FP8), scale.float()


def dequantize_by_hand(quantized: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(quantized.shape[0]) // BLOCK[0]
    cols = torch.arange(quantized.shape[1]) // BLOCK[1]
    return quantized.float() * scale_inv[rows[:, None], cols[None, :]]


@pytest.fixture(scope="module")
def fp8_and_twin(deepseek_v3_checkpoints: dict[str, DeepseekCheckpoint],
                 tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    source = deepseek_v3_checkpoints["lora"].directory
    root = tmp_path_factory.mktemp("fp8_blocks")
    fp8_dir, twin_dir = root / "fp8", root / "twin"
    shutil.copytree(source, fp8_dir)
    shutil.copytree(source, twin_dir)
    tensors = load_file(str(source / "model.safetensors"))
    stored, twin = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(QUANTIZED) and not n.startswith("model.layers.3.")]:
        quantized, scale_inv = quantize_blocks(tensors[name])
        stored[name], stored[name + "_scale_inv"] = quantized, scale_inv
        twin[name] = dequantize_by_hand(quantized, scale_inv)
    save_file(stored, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(twin, str(twin_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return fp8_dir, twin_dir


def test_a_block_scaled_fp8_checkpoint_computes_what_its_dequantized_twin_does(
        fp8_and_twin: tuple[Path, Path]) -> None:
    fp8_dir, twin_dir = fp8_and_twin
    with safe_open(str(fp8_dir / "model.safetensors"), framework="pt") as f:
        name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"  # [40, 64]: a partial row block
        assert f.get_tensor(name).dtype == FP8 and f.get_tensor(name + "_scale_inv").shape == (3, 4)
    fp8, twin = load_checkpoint(str(fp8_dir), progress=False), load_checkpoint(str(twin_dir), progress=False)
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
    with pytest.raises(CheckpointMismatchError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight_scale_inv'"):
        load_checkpoint(str(broken), progress=False)
