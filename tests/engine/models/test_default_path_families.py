"""The CPU default path (`--decode-weights q4`) for every family, on the tiny random checkpoints
transformers writes: float linears quantized at load into Q8_0 blocks and MoE experts as native
per-expert linears, against the same checkpoint in float32 (`--exact`, which the families' own
tests hold equal to transformers).

Agreement, defined for near-tied tiny random models: both engines are fed float32's greedy tokens
(teacher forcing), so every step compares the same context; then (1) the median over steps of the
largest logit difference stays under a quarter of the logits' standard deviation (measured
0.06-0.19 of it, the MoE families highest: Q8_0 weights and 8-bit activations err by ~1% per
linear, which the layers amplify, and a router's near tie can pick another expert) and (2) the
default path picks float32's token on most steps (measured 88-100%; a near tie of the logits flips
under any perturbation, so not all). And the default path's tokens do not depend on the batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.layers.native_linear import NativeQuantLinear
from engine.loader import load_checkpoint
from engine.model_runner import ModelRunner
from tests.engine.models._greedy import greedy

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(40, 60)), [200, 100, 50, 25, 12]]
NUM_NEW_TOKENS = 8
MAX_MEDIAN_ERROR_PER_SPREAD = 0.25
MIN_TOKEN_AGREEMENT = 0.75


@pytest.fixture(autouse=True)
def _native_kernels() -> None:
    from engine.kernels import cpu as native

    # no compiler or no AVX2: the default path keeps float32 (tested elsewhere)
    if not native.load():
        pytest.skip("the native CPU kernels are not available here")


def _runner(directory: Path, decode_weights: str) -> ModelRunner:
    checkpoint = load_checkpoint(directory, progress=False)
    config = EngineConfig(model_path=str(directory), num_threads=1, dtype="float32",
                          decode_weights=decode_weights,
                          cache=CacheConfig(block_size=16, kv_cache_memory_bytes=16 << 20,
                                            enable_prefix_caching=False))
    return ModelRunner(config, checkpoint.config, dict(checkpoint.weights), dict(checkpoint.raw))


@pytest.fixture(scope="module")
def directories(tmp_path_factory: pytest.TempPathFactory,  # type: ignore[no-untyped-def]
                qwen3_checkpoints: dict, gemma3_checkpoint,
                deepseek_v3_checkpoints: dict) -> dict[str, Path]:
    """Family -> a tiny checkpoint directory: the session's, plus Mixtral, a Llama 4 MoE and a
    gpt-oss written here (the session's gpt-oss has initializer_range 0.3 and sinks of sd 2, so
    chaotic that rounding its attention weights alone to Q8_0, computed in float32, moves the
    logits by their spread)."""
    import transformers

    from tests.engine.models._checkpoints import write_checkpoint
    from tests.engine.models._gpt_oss import make_config
    from tests.engine.models._gpt_oss import write_tokenizer as write_gpt_oss_tokenizer
    from tests.engine.models._llama4 import make_config as llama4_make_config
    from tests.engine.models._llama4 import write_tokenizer as llama4_write_tokenizer

    root = tmp_path_factory.mktemp("default-path")
    (root / "llama4").mkdir()  # the session's Llama 4 experts are 48 wide: not blocks of 32
    llama4_config = llama4_make_config("moe", llama4_write_tokenizer(root / "llama4"))
    llama4_config.intermediate_size = 64
    torch.manual_seed(0)
    (transformers.Llama4ForCausalLM(llama4_config).to(torch.float32).eval()
     .save_pretrained(root / "llama4"))
    (root / "mixtral").mkdir()
    write_checkpoint("mixtral", root / "mixtral")
    (root / "gpt_oss").mkdir()
    config = make_config(write_gpt_oss_tokenizer(root / "gpt_oss"))
    config.initializer_range = 0.05
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32).eval().save_pretrained(root / "gpt_oss")
    return {"qwen3": qwen3_checkpoints["qwen3"].directory,
            "qwen3_moe": qwen3_checkpoints["qwen3_moe"].directory,
            "mixtral": root / "mixtral", "gemma3": gemma3_checkpoint.directory,
            "gpt_oss": root / "gpt_oss", "llama4_moe": root / "llama4",
            "deepseek_v3": deepseek_v3_checkpoints["lora"].directory}


EXPECTED_EXPERTS = {"qwen3": None, "gemma3": None}  # else "q8_0-native (quantized at load)"
EXPECTED_STEP = {"qwen3": "NativeDecodeStep", "qwen3_moe": "NativeMoEDecodeStep",
                 "mixtral": "NativeMoEDecodeStep"}  # the others: the general forward


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mixtral", "gemma3", "gpt_oss",
                                    "llama4_moe", "deepseek_v3"])
def test_default_path_quantizes_every_family_at_load_and_follows_float32(
        family: str, directories: dict[str, Path]) -> None:
    exact, default = _runner(directories[family], "float"), _runner(directories[family], "q4")
    info = default.compute_info
    assert (info["weights"], info["weights_source"]) == ("q8_0-native", "quantized at load")
    assert info["experts"] == EXPECTED_EXPERTS.get(family, "q8_0-native (quantized at load)")
    assert info["native_step"] == EXPECTED_STEP.get(family)
    assert exact.compute_info["weights"] == "float32"
    for layer in default.model.layers:  # routers stay float; a shared expert is native like any MLP
        mlp = getattr(layer, "mlp", None)  # (Gemma 3's layer holds its MLP's linears itself)
        router, shared = getattr(mlp, "router", None), getattr(mlp, "shared", None)
        assert not isinstance(router, NativeQuantLinear)
        assert shared is None or isinstance(shared.down, NativeQuantLinear)
    assert exact.compute_info["experts"] in (None, "float32")

    tokens, exact_logits = greedy(exact, PROMPTS, NUM_NEW_TOKENS)
    _, default_logits = greedy(default, PROMPTS, NUM_NEW_TOKENS, forced=tokens)
    errors = torch.cat([(e - d).abs().amax(dim=-1)
                        for e, d in zip(exact_logits, default_logits, strict=True)])
    spread = torch.cat(exact_logits).std()
    assert errors.median() < MAX_MEDIAN_ERROR_PER_SPREAD * spread, (errors.median(), spread)
    assert errors.min() > 0  # the default path does compute differently
    same = torch.cat([e.argmax(-1) == d.argmax(-1)
                      for e, d in zip(exact_logits, default_logits, strict=True)])
    assert same.float().mean() >= MIN_TOKEN_AGREEMENT, same.float().mean()

    alone = greedy(default, PROMPTS[2:3], NUM_NEW_TOKENS)[0][0]
    # the same request in a batch of 4
    assert greedy(default, PROMPTS, NUM_NEW_TOKENS)[0][2] == alone


def test_mxfp4_experts_take_native_q8_0_blocks_that_hold_their_values_exactly(
        gpt_oss_checkpoints: dict) -> None:
    """gpt-oss's MXFP4 experts re-blocked into Q8_0 at load dequantize to the MXFP4 values bit for
    bit."""
    import gguf

    from engine.layers.block_quant import mxfp4_to_q8_0
    from engine.layers.mxfp4 import MXFP4Weight, quantize_mxfp4

    default = _runner(gpt_oss_checkpoints["mxfp4"].directory, "q4")
    assert default.compute_info["experts"] == "q8_0-native (quantized at load)"
    weight = torch.randn(16, 96) * torch.logspace(-3, 1, 16)[:, None]  # rows of many scales
    blocks, scales = quantize_mxfp4(weight)
    rows = mxfp4_to_q8_0(blocks, scales)
    back = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.Q8_0)
    expected = MXFP4Weight(blocks[None], scales[None]).dequantize(torch.float32)[0]
    assert torch.equal(torch.from_numpy(back), expected)


def test_a_gguf_moe_runs_its_own_expert_blocks_on_the_default_path(tmp_path: Path) -> None:
    """A qwen3moe GGUF with Q4_0 attention and Q8_0 experts: the default path runs the file's
    blocks (nothing quantized at load, the experts too) and follows the float32 engine on the same
    (dequantized) weights."""
    from tests.engine.models._qwen3 import write_checkpoints, write_gguf

    # every layer sparse
    hf = write_checkpoints(tmp_path, ("qwen3_moe-sparse",))["qwen3_moe-sparse"]
    path = tmp_path / "qwen3_moe-sparse.gguf"
    write_gguf(hf.directory, path, linear_type="Q4_0", expert_type="Q8_0")
    exact, default = _runner(path, "float"), _runner(path, "q4")
    info = default.compute_info
    assert (info["weights"], info["weights_source"], info["experts"]) == ("q4-native", "file",
                                                                          "q8_0-native (file)")
    tokens, exact_logits = greedy(exact, PROMPTS, NUM_NEW_TOKENS)
    _, default_logits = greedy(default, PROMPTS, NUM_NEW_TOKENS, forced=tokens)
    errors = torch.cat([(e - d).abs().amax(dim=-1)
                        for e, d in zip(exact_logits, default_logits, strict=True)])
    assert 0 < errors.median() < MAX_MEDIAN_ERROR_PER_SPREAD * torch.cat(exact_logits).std()


def test_quantize_at_load_q4_1_takes_q4_1_blocks(directories: dict[str, Path]) -> None:
    """`--quantize-at-load q4_1`: float weights go into Q4_1 blocks (the lm head stays Q8_0)."""
    import argparse

    from engine.engine_args import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config_from_args(parser.parse_args(["--model", str(directories["qwen3_moe"]),
                                                        "--quantize-at-load", "q4_1", "--threads",
                                                        "1"]))
    assert (config.decode_weights, config.quantize_at_load) == ("q4", "q4_1")
    checkpoint = load_checkpoint(directories["qwen3_moe"], progress=False)
    runner = ModelRunner(config, checkpoint.config, dict(checkpoint.weights), dict(checkpoint.raw))
    info = runner.compute_info
    assert (info["weights"], info["experts"]) == ("q4-native", "q4-native (quantized at load)")
    assert (isinstance(runner.model.lm_head, NativeQuantLinear)
            and runner.model.lm_head.block_type == "Q8_0")


def test_experts_the_kernels_cannot_block_stay_float_beside_native_linears(
        llama4_checkpoints: dict) -> None:
    """The session's Llama 4 MoE has experts 48 wide (not blocks of 32): they stay float32 while
    the attention and dense layers take Q8_0, and the mix still follows float32."""
    directory = llama4_checkpoints["moe"].directory
    exact, default = _runner(directory, "float"), _runner(directory, "q4")
    assert ((default.compute_info["weights"], default.compute_info["experts"])
            == ("q8_0-native", "float32"))
    tokens, exact_logits = greedy(exact, PROMPTS, NUM_NEW_TOKENS)
    _, default_logits = greedy(default, PROMPTS, NUM_NEW_TOKENS, forced=tokens)
    errors = torch.cat([(e - d).abs().amax(dim=-1)
                        for e, d in zip(exact_logits, default_logits, strict=True)])
    assert 0 < errors.median() < MAX_MEDIAN_ERROR_PER_SPREAD * torch.cat(exact_logits).std()
