"""qwen3 / qwen3moe GGUF files (written here as llama.cpp's converter lays them out, from the tiny
transformers checkpoints) load to the same config and bit-identical weights as the HF directories,
the engine serves them with the GGUF's own vocabulary and generates transformers' tokens, and the
CPU q4 mode (`--decode-weights q4`) runs qwen3 on the file's 4-bit blocks in the fused native
step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import pytest
import torch

from chat.gguf_metadata import read_gguf_header
from contracts.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.loader import load_checkpoint
from engine.loader.checkpoint import UnsupportedCheckpointError
from tests.engine.fakes import assert_idle_and_clean, generate
from tests.engine.models._greedy import hf_greedy
from tests.engine.models._qwen3 import TinyCheckpoint, write_checkpoints, write_gguf

PROMPT = [5, 17, 99, 3, 250, 42, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 200, 31, 64]
NUM_NEW_TOKENS = 10


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory,
                qwen3_checkpoints: dict[str, TinyCheckpoint]) -> dict[str, TinyCheckpoint]:
    """qwen3 (dense, tied) and an all-sparse qwen3_moe (a qwen3moe GGUF has no dense layers)."""
    sparse = write_checkpoints(tmp_path_factory.mktemp("qwen3-gguf"), ("qwen3_moe-sparse",))
    return {"qwen3": qwen3_checkpoints["qwen3"], "qwen3_moe": sparse["qwen3_moe-sparse"]}


def engine_for(path: Path, decode_weights: str = "float") -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(
        model_path=str(path), num_threads=1, dtype="float32", decode_weights=decode_weights,
        cache=CacheConfig(kv_cache_memory_bytes=4 << 20),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)), progress=False)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_gguf_loads_as_the_hf_directory_and_generates_transformers_tokens(
        name: str, checkpoints: dict[str, TinyCheckpoint], tmp_path: Path) -> None:
    source = checkpoints[name]
    path = tmp_path / f"{name}.gguf"
    write_gguf(source.directory, path)
    arch = gguf.MODEL_ARCH.QWEN3 if name == "qwen3" else gguf.MODEL_ARCH.QWEN3MOE
    known = {gguf.TENSOR_NAMES[t].format(bid=i) + suffix for t in gguf.MODEL_TENSORS[arch]
             for i in range(4) for suffix in (".weight", ".bias")}
    _, infos = read_gguf_header(path)
    assert {info.name for info in infos} <= known  # llama.cpp's tensor names for the architecture

    from_gguf = load_checkpoint(path, progress=False)
    from_dir = load_checkpoint(source.directory, progress=False)
    assert (dataclasses.replace(from_gguf.config, rms_norm_eps=1e-6, model_id="")
            == dataclasses.replace(from_dir.config, model_id=""))  # the file's eps is a float32
    fused = {n for n in from_gguf.weights
             if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert bool(fused) == (name == "qwen3_moe")
    for tensor_name, tensor in from_gguf.weights.items():
        if tensor_name not in fused:
            assert torch.equal(tensor, from_dir.weights[tensor_name]), tensor_name

    engine = engine_for(path)
    result = generate(engine, {"p": PROMPT}, SamplingParams(temperature=0.0,
                                                            max_tokens=NUM_NEW_TOKENS,
                                                            ignore_eos=True, logprobs=True))["p"]
    tokens, logprobs = hf_greedy(source.model, PROMPT, NUM_NEW_TOKENS)
    assert result.token_ids == tokens
    assert max(abs(a.logprob - b) for a, b in zip(result.logprobs, logprobs, strict=True)) < 2e-3
    assert engine.tokenizer.decode(tokens) == result.text  # the GGUF's own vocabulary
    assert_idle_and_clean(engine)


def test_a_gguf_tensor_the_architecture_does_not_have_is_named(
        checkpoints: dict[str, TinyCheckpoint], tmp_path: Path) -> None:
    path = tmp_path / "shared-expert.gguf"
    write_gguf(checkpoints["qwen3_moe"].directory, path,
               extra_tensors={"blk.0.ffn_gate_shexp.weight": torch.zeros(32, 64)})
    with pytest.raises(UnsupportedCheckpointError, match=r"^shared-expert\.gguf: GGUF tensor "
                                                         r"'blk\.0\.ffn_gate_shexp\.weight' is not "
                                                         r"part"):
        load_checkpoint(path, progress=False)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_q4_mode_runs_qwen3_on_the_files_4_bit_blocks(name: str,
                                                      checkpoints: dict[str, TinyCheckpoint],
                                                      tmp_path: Path) -> None:
    """Q4_0 projections: q4 mode computes them on the blocks (8-bit activations), float mode on the
    same weights dequantized; the two agree to the q4 mode's approximation. Dense qwen3 runs every
    row through the fused native step; qwen3_moe through its MoE variant (the file's F32 experts
    quantized at load into Q8_0, the router float)."""
    from engine.kernels import cpu as native
    from engine.layers.native_linear import NativeQuantLinear
    from engine.layers.q4_linear import Q4DecodeLinear

    path = tmp_path / f"{name}-q4_0.gguf"
    write_gguf(checkpoints[name].directory, path, linear_type="Q4_0")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=True,
                            top_logprobs=5)
    exact = generate(engine_for(path), {"p": PROMPT}, params)["p"]
    q4_engine = engine_for(path, decode_weights="q4")
    expected_type = NativeQuantLinear if native.load() else Q4DecodeLinear
    assert isinstance(q4_engine.runner.model.layers[0].qkv, expected_type)
    if native.load():
        expected_step = "NativeDecodeStep" if name == "qwen3" else "NativeMoEDecodeStep"
        assert q4_engine.runner._native_decode.name == expected_step
    q4 = generate(q4_engine, {"p": PROMPT}, params)["p"]
    assert q4.token_ids[:2] == exact.token_ids[:2]
    first_exact, first_q4 = dict(exact.logprobs[0].top), dict(q4.logprobs[0].top)
    for token in set(first_exact) & set(first_q4):
        assert abs(first_exact[token] - first_q4[token]) < 0.2  # measured: <= 0.11
    assert_idle_and_clean(q4_engine)
