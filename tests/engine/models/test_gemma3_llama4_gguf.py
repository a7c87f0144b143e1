"""gemma3 and llama4 GGUFs, written here from the tiny transformers checkpoints as llama.cpp's
convert_hf_to_gguf lays them out (Gemma's norms stored as 1 + w; Llama 4's experts split and
transposed, its llama3 rope baked into a `rope_freqs` tensor, q/k unpermuted), load to the HF
directory's config and weights and generate transformers' greedy tokens on a prompt longer than
Gemma's window and than three of Llama 4's chunks.

The tiny models differ from llama.cpp's hard-coded choices for these architectures (Gemma's local
rope base and layer pattern, its query_pre_attn_scalar; Llama 4's chunk of 8,192, its NoPE layer
pattern and temperature tuning), so the files carry those in gguf's keys for them
(`rope.freq_base_swa`, `attention.sliding_window_pattern`, `attention.scale`,
`attention.sliding_window`, `attention.temperature_scale` / `temperature_length`); without them the
loaders fall back to llama.cpp's values, which the last tests check."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import gguf
import pytest
import torch

from chat.gguf_metadata import read_gguf_header
from contracts.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.layers.rotary import RotaryEmbedding
from engine.loader import load_checkpoint
from tests.engine.fakes import assert_idle_and_clean, generate
from tests.engine.models._checkpoints import add_gguf_vocabulary, finish_gguf
from tests.engine.models._greedy import hf_greedy
from tests.engine.models._llama4 import CHUNK_SIZE
from tests.engine.models._qwen3 import TinyCheckpoint

PROMPT = [(7 * i + 11) % 300 + 6 for i in range(3 * CHUNK_SIZE + 5)]  # no special ids (0..5)
NUM_NEW_TOKENS = 6
_TOP = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
        "lm_head.weight": "output"}
_GEMMA3 = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
           "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
           "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
           "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}
_LLAMA4 = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
           "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "feed_forward.gate_proj": "ffn_gate",
           "feed_forward.up_proj": "ffn_up", "feed_forward.down_proj": "ffn_down",
           "feed_forward.router": "ffn_gate_inp",
           "feed_forward.shared_expert.gate_proj": "ffn_gate_shexp",
           "feed_forward.shared_expert.up_proj": "ffn_up_shexp",
           "feed_forward.shared_expert.down_proj": "ffn_down_shexp"}


def _writer(directory: Path, path: Path, arch: str) -> tuple[gguf.GGUFWriter, dict, dict]:  # type: ignore[type-arg]
    config = json.loads((directory / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), arch)
    writer.quantized = False  # type: ignore[attr-defined]  # set by the writers' `quantized`
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    add_gguf_vocabulary(writer, tokenizer, "qwen2", lambda t: t.startswith("<"),
                        config["vocab_size"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"][0])
    return writer, config, _safetensors(directory)


def _safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def _add(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor) -> None:
    """F32, or Q8_0 in a `quantized` file for every matrix whose rows are whole 32-blocks (as
    llama.cpp quantizes: norms and odd-sized rows stay float)."""
    values = tensor.float().contiguous().numpy()
    if writer.quantized and values.ndim >= 2 and values.shape[-1] % 32 == 0:  # type: ignore[attr-defined]
        q8 = gguf.GGMLQuantizationType.Q8_0
        writer.add_tensor(name, gguf.quants.quantize(values, q8), raw_dtype=q8)
    else:
        writer.add_tensor(name, values)


def write_gemma3_gguf(directory: Path, path: Path, *, llama_cpp_defaults: bool = False,
                      quantized: bool = False) -> None:
    w, config, tensors = _writer(directory, path, "gemma3")
    w.quantized = quantized  # type: ignore[attr-defined]
    full = config["rope_parameters"]["full_attention"]
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_rope_freq_base(full["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(full["factor"])
    w.add_sliding_window(config["sliding_window"])
    w.add_final_logit_softcapping(config["final_logit_softcapping"])
    if not llama_cpp_defaults:  # what llama.cpp hard-codes, as this model has it
        w.add_rope_freq_base_swa(config["rope_parameters"]["sliding_attention"]["rope_theta"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])
        w.add_attention_scale(config["query_pre_attn_scalar"] ** -0.5)
    for name, tensor in sorted(tensors.items()):
        if name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp stores Gemma's 1 + w
        if name in _TOP:
            _add(w, _TOP[name] + ".weight", tensor)
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        _add(w, f"blk.{layer}.{_GEMMA3[rest.removesuffix('.weight')]}.weight", tensor)
    finish_gguf(w)


def _llama3_rope_factors(config: dict) -> list[float]:  # type: ignore[type-arg]
    """convert_hf_to_gguf's `rope_freqs` for llama3 scaling (one factor per rotary frequency)."""
    rope, dim = config["rope_parameters"], config["head_dim"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def write_llama4_gguf(directory: Path, path: Path, *, quantized: bool = False) -> None:
    w, config, tensors = _writer(directory, path, "llama4")
    w.quantized = quantized  # type: ignore[attr-defined]
    w.add_feed_forward_length(config["intermediate_size_mlp"])
    w.add_expert_feed_forward_length(config["intermediate_size"])
    w.add_expert_count(config["num_local_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_interleave_moe_layer_step(config["interleave_moe_layer_step"])
    w.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(config["head_dim"])
    w.add_sliding_window(config["attention_chunk_size"])
    w.add_sliding_window_pattern([bool(v) for v in config["no_rope_layers"]])
    w.add_attn_temperature_scale(config["attn_scale"])
    w.add_attn_temperature_length(config["floor_scale"])
    _add(w, "rope_freqs.weight", torch.tensor(_llama3_rope_factors(config)))
    for name, tensor in sorted(tensors.items()):
        if name in _TOP:
            _add(w, _TOP[name] + ".weight", tensor)
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        blk = f"blk.{layer}."
        if rest == "feed_forward.experts.gate_up_proj":  # [E, H, 2I] -> 2 x [E, I, H]
            gate, up = tensor.transpose(-1, -2).chunk(2, dim=-2)
            _add(w, blk + "ffn_gate_exps.weight", gate)
            _add(w, blk + "ffn_up_exps.weight", up)
        elif rest == "feed_forward.experts.down_proj":  # [E, I, H] -> [E, H, I]
            _add(w, blk + "ffn_down_exps.weight", tensor.transpose(-1, -2))
        else:
            _add(w, f"{blk}{_LLAMA4[rest.removesuffix('.weight')]}.weight", tensor)
    finish_gguf(w)


def _known_names(arch: gguf.MODEL_ARCH) -> set[str]:
    return {gguf.TENSOR_NAMES[t].format(bid=i) + ".weight" for t in gguf.MODEL_TENSORS[arch]
            for i in range(4)}


def _engine(path: Path) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(
        model_path=str(path), num_threads=1, dtype="float32",
        cache=CacheConfig(kv_cache_memory_bytes=4 << 20),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4)), progress=False)


def _assert_greedy_tokens_are_transformers(path: Path, source: TinyCheckpoint) -> None:
    engine = _engine(path)
    result = generate(engine, {"p": PROMPT}, SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=True))["p"]
    tokens, logprobs = hf_greedy(source.model, PROMPT, NUM_NEW_TOKENS)
    assert result.token_ids == tokens
    assert max(abs(a.logprob - b) for a, b in zip(result.logprobs, logprobs, strict=True)) < 2e-3
    assert_idle_and_clean(engine)


def _float32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def test_a_gemma3_gguf_loads_as_the_hf_directory_and_generates_transformers_tokens(
        gemma3_checkpoint: TinyCheckpoint, tmp_path: Path) -> None:
    path = tmp_path / "gemma3-tiny.gguf"
    write_gemma3_gguf(gemma3_checkpoint.directory, path)
    _, infos = read_gguf_header(path)
    assert {info.name for info in infos} <= _known_names(gguf.MODEL_ARCH.GEMMA3)
    from_gguf = load_checkpoint(path, progress=False)
    from_dir = load_checkpoint(gemma3_checkpoint.directory, progress=False)
    eps = _float32(from_dir.config.rms_norm_eps)
    assert dataclasses.replace(from_gguf.config, model_id="", rms_norm_eps=eps) == \
        dataclasses.replace(from_dir.config, model_id="", rms_norm_eps=eps)
    assert from_gguf.weights.keys() == from_dir.weights.keys()
    for name, tensor in from_dir.weights.items():
        if name.endswith("norm.weight"):  # (1 + w) - 1 in float32: w to within an ulp of 1 + w
            assert torch.allclose(from_gguf.weights[name], tensor, rtol=0, atol=5e-7), name
        else:
            assert torch.equal(from_gguf.weights[name], tensor), name
    _assert_greedy_tokens_are_transformers(path, gemma3_checkpoint)


def test_a_llama4_gguf_loads_as_the_hf_directory_and_generates_transformers_tokens(
        llama4_checkpoints: dict[str, TinyCheckpoint], tmp_path: Path) -> None:
    source = llama4_checkpoints["moe"]
    path = tmp_path / "llama4-tiny.gguf"
    write_llama4_gguf(source.directory, path)
    _, infos = read_gguf_header(path)
    assert {info.name for info in infos} <= _known_names(gguf.MODEL_ARCH.LLAMA4)
    from_gguf = load_checkpoint(path, progress=False)
    from_dir = load_checkpoint(source.directory, progress=False)
    eps = _float32(from_dir.config.rms_norm_eps)
    assert (dataclasses.replace(from_gguf.config, model_id="", rms_norm_eps=eps, rope_scaling=None)
            == dataclasses.replace(from_dir.config, model_id="", rms_norm_eps=eps,
                                   rope_scaling=None))
    assert dict(from_gguf.config.rope_scaling or ())["rope_type"] == "freq_factors"
    config = from_dir.config  # the rope_freqs factors give llama3's tables
    tables = [RotaryEmbedding(config.head_dim, 512, config.rope_theta, dict(c.rope_scaling or ()))
              for c in (from_dir.config, from_gguf.config)]
    assert torch.allclose(tables[0].cos, tables[1].cos, atol=1e-5)
    assert torch.allclose(tables[0].sin, tables[1].sin, atol=1e-5)
    assert from_gguf.weights.keys() == from_dir.weights.keys()
    for name, tensor in from_dir.weights.items():
        assert torch.equal(from_gguf.weights[name], tensor), name
    _assert_greedy_tokens_are_transformers(path, source)


def test_without_the_models_own_keys_a_gemma3_gguf_gets_llama_cpps_choices(
        gemma3_checkpoint: TinyCheckpoint, tmp_path: Path) -> None:
    from engine.loader.gguf_gemma3 import hf_config

    path = tmp_path / "gemma3-defaults.gguf"
    write_gemma3_gguf(gemma3_checkpoint.directory, path, llama_cpp_defaults=True)
    metadata, _ = read_gguf_header(path)
    config = hf_config(metadata)
    assert config["layer_types"] == ["sliding_attention"] * 4  # pattern 6: the 6th is global
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10_000.0
    assert config["query_pre_attn_scalar"] == 32  # head_dim (hidden / heads only for the 27B)
    assert hf_config({**metadata, "gemma3.block_count": 62})["query_pre_attn_scalar"] == 16


def test_without_the_models_own_keys_a_llama4_gguf_gets_llama_cpps_choices(
        llama4_checkpoints: dict[str, TinyCheckpoint], tmp_path: Path) -> None:
    from engine.loader.checkpoint import UnsupportedCheckpointError
    from engine.loader.gguf_llama4 import hf_config

    path = tmp_path / "llama4-defaults.gguf"
    write_llama4_gguf(llama4_checkpoints["moe"].directory, path)
    metadata, _ = read_gguf_header(path)
    ours = ("llama4.attention.sliding_window", "llama4.attention.sliding_window_pattern",
            "llama4.attention.temperature_scale", "llama4.attention.temperature_length")
    plain = {k: v for k, v in metadata.items() if k not in ours}
    config = hf_config(plain, None)
    assert config["attention_chunk_size"] == 8192 and config["no_rope_layers"] == [1, 1, 1, 0]
    assert (config["attn_scale"], config["floor_scale"]) == (0.1, 8192)
    assert config["moe_layers"] == [1, 3] and config["use_qk_norm"]
    assert not hf_config({**plain, "llama4.expert_count": 128}, None)["use_qk_norm"]  # Maverick
    mobile = hf_config({**plain, "llama4.attention.sliding_window": 0}, None)
    assert mobile["attention_chunk_size"] is None and mobile["no_rope_layers"] == [1] * 4
    with pytest.raises(UnsupportedCheckpointError, match="llama4.embedding_length"):
        hf_config({k: v for k, v in plain.items() if k != "llama4.embedding_length"}, None)


@pytest.mark.parametrize("family", ["gemma3", "llama4"])
def test_a_q8_0_gguf_loads_its_dequantized_blocks_and_generates_what_transformers_does_with_them(
        family: str, gemma3_checkpoint: TinyCheckpoint,
        llama4_checkpoints: dict[str, TinyCheckpoint], tmp_path: Path) -> None:
    """Published GGUFs are quantized: each Q8_0 matrix loads as gguf's own dequantization of its
    blocks, and the engine's tokens are transformers' on the same (dequantized) weights."""
    import copy

    source = gemma3_checkpoint if family == "gemma3" else llama4_checkpoints["moe"]
    path = tmp_path / f"{family}-q8_0.gguf"
    (write_gemma3_gguf if family == "gemma3" else write_llama4_gguf)(source.directory, path,
                                                                     quantized=True)
    _, infos = read_gguf_header(path)
    assert sum(info.ggml_type == gguf.GGMLQuantizationType.Q8_0 for info in infos) >= 10
    from_gguf = load_checkpoint(path, progress=False)
    from_dir = load_checkpoint(source.directory, progress=False)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.embed_tokens.weight"):
        dense = from_dir.weights[name].numpy()
        expected = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(dense, q8), q8))
        assert (torch.equal(from_gguf.weights[name], expected)
                and not torch.equal(expected, from_dir.weights[name]))
    model = copy.deepcopy(source.model)
    missing, unexpected = model.load_state_dict(from_gguf.weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if family == "gemma3":
        model.tie_weights()
    _assert_greedy_tokens_are_transformers(path,
                                           TinyCheckpoint(source.name, source.directory, model))
