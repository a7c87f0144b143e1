"""Block-scaled FP8 checkpoints of gemma3_text and llama4_text served from their blocks as stored:
the loader keeps each 2-D FP8 weight (`RawFP8Blocks`) beside its dequantized twin, and where the
block-scaled kernel is native (CUDA, compute capability >= 8.9) the linear factory serves each
projection as an FP8BlockLinear, fused q/k/v and gate/up included (Llama 4's q/k rows, which the
model permutes within their heads for its rope, reordered alike: each keeps its block's scale). On
the CPU the factory's choice is forced here; the layer then dequantizes per call, so the tokens and
logits are the twin's. The GPU test runs the w8a8 kernel itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.layers.fp8_block_linear import FP8BlockLinear
from engine.loader import load_checkpoint
from engine.loader.fp8_blocks import RawFP8Blocks
from engine.model_runner import ModelRunner
from tests.engine.models._fp8_blocks import write_fp8_checkpoint
from tests.engine.models._greedy import greedy
from tests.engine.models._qwen3 import TinyCheckpoint

PROMPTS = [[(7 * i + 11) % 300 + 6 for i in range(40)], [6, 17, 99, 3, 250, 42, 7]]


def _projections(name: str, tensor: torch.Tensor) -> bool:
    """Every 2-D projection (routers, norms, embeddings and stacked experts stay as they are)."""
    return name.endswith("_proj.weight") and tensor.dim() == 2


def _runner(directory: Path, device: str, dtype: str = "float32") -> ModelRunner:
    from engine.config import CacheConfig, EngineConfig
    from tests.engine.models._greedy import BLOCK_SIZE

    checkpoint = load_checkpoint(str(directory), progress=False)
    config = EngineConfig(model_path=str(directory), num_threads=1, dtype=dtype, device=device,
                          cache=CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory_bytes=16 << 20,
                                            enable_prefix_caching=False))
    return ModelRunner(config, checkpoint.config, dict(checkpoint.weights), dict(checkpoint.raw))


@pytest.fixture(scope="module")
def checkpoints(gemma3_checkpoint: TinyCheckpoint, llama4_checkpoints: dict[str, TinyCheckpoint],
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    return {name: write_fp8_checkpoint(source.directory, tmp_path_factory.mktemp(name),
                                       _projections)
            for name, source in (("gemma3", gemma3_checkpoint),
                                 ("llama4", llama4_checkpoints["moe"]))}


def _served_fp8(module: object, depth: int = 3) -> list[str]:
    """The paths of the model's FP8BlockLinear layers (attributes, list items), `depth` levels
    down ("layers[1].o_proj", "layers[1].mlp.shared.gate_up")."""
    names = []
    for name, value in vars(module).items():
        items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
        for i, item in items:
            path = name if i is None else f"{name}[{i}]"
            if isinstance(item, FP8BlockLinear):
                names.append(path)
            elif depth and hasattr(item, "__dict__") and not isinstance(item, (torch.Tensor, type)):
                names += [f"{path}.{sub}" for sub in _served_fp8(item, depth - 1)]
    return names


@pytest.mark.parametrize("family", ["gemma3", "llama4"])
def test_fp8_blocks_are_served_as_stored_and_compute_what_the_twin_does(
        family: str, checkpoints: dict[str, tuple[Path, Path]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    fp8_dir, twin_dir = checkpoints[family]
    raw = load_checkpoint(str(fp8_dir), progress=False).raw
    assert raw and all(isinstance(r, RawFP8Blocks) and r.wq.dtype == torch.float8_e4m3fn
                       for r in raw.values())
    import engine.layers.fp8_block_linear as fp8_block_linear

    monkeypatch.setattr(fp8_block_linear, "can_run_w8a8", lambda device: True)  # the factory's test
    fp8 = _runner(fp8_dir, "cpu")
    monkeypatch.undo()  # the layers dequantize per call on the CPU
    served = _served_fp8(fp8.model)
    layer1 = [n for n in served if n.startswith("layers[1].")]
    if family == "gemma3":
        assert sorted(n.rsplit(".", 1)[-1] for n in layer1) == ["down", "gate_up", "o_proj", "qkv"]
    else:  # layer 1 is MoE: its shared expert's blocks (the routed experts are stacked, dense)
        assert sorted(n.rsplit(".", 1)[-1] for n in layer1) == ["down", "gate_up", "o_proj", "qkv"]
        assert all(".shared." in n for n in layer1 if "gate_up" in n or "down" in n)
    twin = _runner(twin_dir, "cpu")
    assert not _served_fp8(twin.model)
    ours, our_logits = greedy(fp8, PROMPTS, 5)
    theirs, their_logits = greedy(twin, PROMPTS, 5)
    assert ours == theirs
    for a, b in zip(our_logits, their_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_without_fp8_tensor_cores_the_factory_serves_the_dense_weights(
        checkpoints: dict[str, tuple[Path, Path]]) -> None:
    assert not _served_fp8(_runner(checkpoints["gemma3"][0], "cpu").model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["gemma3", "llama4"])
def test_on_a_gpu_the_block_kernel_serves_the_checkpoint(
        family: str, checkpoints: dict[str, tuple[Path, Path]]) -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the block-scaled kernel needs FP8 tensor cores (compute capability >= 8.9)")
    fp8_dir, twin_dir = checkpoints[family]
    fp8, twin = _runner(fp8_dir, "cuda", "bfloat16"), _runner(twin_dir, "cuda", "bfloat16")
    assert _served_fp8(fp8.model) and not _served_fp8(twin.model)
    _, our_logits = greedy(fp8, PROMPTS, 1)
    _, their_logits = greedy(twin, PROMPTS, 1)
    for a, b in zip(our_logits, their_logits, strict=True):  # activations quantized per block
        assert (a.float() - b.float()).abs().max() < 0.1 * b.float().abs().max()
