"""gpt-oss through the engine matches transformers' GptOss: greedy tokens equal and logprobs within
2e-3 (float32) on prompts longer than the sliding window, for dense experts and for MXFP4 experts
laid out as the released checkpoints store them; the same tokens alone and among concurrent
requests, with chunked prefill, after a prefix-cache hit and after preemption, with no KV block
leaked."""

from __future__ import annotations

import functools
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from contracts.sampling_params import SamplingParams
from engine.loader import load_checkpoint
from tests.engine.fakes import assert_idle_and_clean, generate
from tests.engine.models import _serving_checks as serving
from tests.engine.models._gpt_oss import SLIDING_WINDOW, GptOssCheckpoint
from tests.engine.models._greedy import greedy, hf_greedy, make_runner

NUM_NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=True)
_rng = random.Random(7)
PROMPTS = {f"p{n}": [_rng.randrange(0, 300) for _ in range(n)] for n in (19, 29, 41)}
assert all(len(p) > 2 * SLIDING_WINDOW for p in PROMPTS.values())


make_engine = functools.partial(serving.make_engine, kv_cache_memory_bytes=32 << 20)  # overridable


@pytest.fixture(scope="module")
def reference(gpt_oss_checkpoints: dict[str, GptOssCheckpoint]) -> dict[str, dict[str, tuple]]:
    """transformers' (tokens, logprobs) per checkpoint and prompt."""
    return {name: {p: hf_greedy(gpt_oss_checkpoints[name].model, prompt, NUM_NEW_TOKENS)
                   for p, prompt in PROMPTS.items()} for name in ("dense", "mxfp4")}


@pytest.mark.parametrize("name", ["dense", "mxfp4"])
def test_engine_generates_transformers_greedy_tokens_and_logprobs(
        name: str, gpt_oss_checkpoints: dict[str, GptOssCheckpoint], reference: dict) -> None:
    engine = make_engine(gpt_oss_checkpoints[name].directory)
    serving.check_greedy_parity(engine, PROMPTS, reference[name], GREEDY)


def test_the_prompts_reach_past_the_window_and_the_sinks_matter(
        gpt_oss_checkpoints: dict[str, GptOssCheckpoint], reference: dict) -> None:
    """The parity above can fail: without the window, or without the sinks, transformers itself
    computes other logprobs for these prompts."""
    import copy

    model = gpt_oss_checkpoints["dense"].model
    prompt = PROMPTS["p41"]
    _, expected = reference["dense"]["p41"]
    no_window = copy.deepcopy(model)
    no_window.config.layer_types = ["full_attention"] * len(no_window.config.layer_types)
    for layer in no_window.model.layers:
        layer.self_attn.sliding_window = None
    no_sinks = copy.deepcopy(model)
    with torch.no_grad():
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    for variant in (no_window, no_sinks):
        _, logprobs = hf_greedy(variant, prompt, 2)
        assert abs(logprobs[0] - expected[0]) > 2e-3


def test_mxfp4_experts_compute_exactly_what_their_dequantized_twin_does(
        gpt_oss_checkpoints: dict[str, GptOssCheckpoint]) -> None:
    mxfp4 = load_checkpoint(str(gpt_oss_checkpoints["mxfp4"].directory), progress=False)
    twin = load_checkpoint(str(gpt_oss_checkpoints["twin"].directory), progress=False)
    assert mxfp4.weights["model.layers.0.mlp.experts.gate_up_proj_blocks"].dtype == torch.uint8
    assert "model.layers.0.mlp.experts.gate_up_proj" in twin.weights
    prompts = list(PROMPTS.values())
    ours, our_logits = greedy(make_runner(mxfp4.config, mxfp4.weights), prompts, 6)
    theirs, their_logits = greedy(make_runner(twin.config, twin.weights), prompts, 6)
    assert ours == theirs
    for a, b in zip(our_logits, their_logits, strict=True):
        assert torch.equal(a, b)


def test_tokens_alone_equal_tokens_among_8_concurrent_requests_with_chunked_prefill(
        gpt_oss_checkpoints: dict[str, GptOssCheckpoint], reference: dict) -> None:
    """A 16-token step budget splits every prompt over several steps (chunks cross the window)."""
    engine = make_engine(gpt_oss_checkpoints["dense"].directory, max_num_batched_tokens=16,
                         enable_prefix_caching=False)
    target = PROMPTS["p41"]
    others = {f"o{i}": [_rng.randrange(0, 300) for _ in range(9 + 5 * i)] for i in range(8)}
    serving.check_target_among_8_concurrent(engine, target, others, reference["dense"]["p41"][0],
                                            GREEDY)


def test_a_prefix_cache_hit_continues_with_the_same_tokens(
        gpt_oss_checkpoints: dict[str, GptOssCheckpoint], reference: dict) -> None:
    checkpoint = gpt_oss_checkpoints["dense"]
    engine = make_engine(checkpoint.directory)
    serving.check_prefix_cache_hit(engine, checkpoint.model, PROMPTS["p41"],
                                   reference["dense"]["p41"][0], GREEDY)


def test_outputs_after_preemption_equal_outputs_with_room(
        gpt_oss_checkpoints: dict[str, GptOssCheckpoint], reference: dict) -> None:
    """The smallest KV cache that still holds the longest request alone (41 + 12 tokens: full-layer
    blocks for all of it, window-layer blocks for its window) cannot hold all three at once."""
    directory = gpt_oss_checkpoints["dense"].directory
    bytes_per_block = make_engine(directory).runner.bytes_per_block
    longest = max(map(len, PROMPTS.values())) + NUM_NEW_TOKENS
    for num_blocks in range(-(-longest // 16), 64):
        tight = make_engine(directory, kv_cache_memory_bytes=num_blocks * bytes_per_block,
                            max_num_batched_tokens=16)
        if tight.max_model_len > longest:
            break
    out = generate(tight, PROMPTS, GREEDY)
    assert tight.stats().num_preemptions_total > 0
    for p in PROMPTS:
        assert out[p].token_ids == reference["dense"][p][0], p
    assert_idle_and_clean(tight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantization_equals_transformers_converter(dtype: torch.dtype) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from engine.layers.mxfp4 import dequantize_mxfp4

    gen = torch.Generator().manual_seed(0)
    # [E, N, G, 16]
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (3, 40, 4), dtype=torch.uint8, generator=gen)  # [E, N, G]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, K, N]
    assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), theirs.transpose(1, 2))


# ---- misfits are one line before serving ---------------------------------------------------------
def _broken_copy(source: Path, target: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.mark.parametrize(("edit", "named"), [
    (lambda t: t.pop("model.layers.1.self_attn.sinks"), "model.layers.1.self_attn.sinks"),
    (lambda t: t.update({"model.layers.2.mlp.experts.down_proj_scales":
                         t["model.layers.2.mlp.experts.down_proj_scales"][:, :5].contiguous()}),
     "model.layers.2.mlp.experts.down_proj_scales"),
], ids=["missing_sinks", "misshapen_mxfp4_scales"])
def test_a_missing_or_misshapen_tensor_is_one_error_line_naming_it(
        edit, named: str, gpt_oss_checkpoints: dict[str, GptOssCheckpoint], tmp_path: Path,  # type: ignore[no-untyped-def]
        capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    broken = _broken_copy(gpt_oss_checkpoints["mxfp4"].directory, tmp_path / "broken", edit)
    assert (main(["replica", "--port", "0", "--no-auth", "--threads", "1", "--model", str(broken)])
            == 1)
    assert _error_line(capsys.readouterr().err).count(named) == 1


def test_an_unsupported_quantization_is_one_error_line(
        gpt_oss_checkpoints: dict[str, GptOssCheckpoint], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from cli.main import main

    directory = tmp_path / "fp8"
    shutil.copytree(gpt_oss_checkpoints["dense"].directory, directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (directory / "config.json").write_text(json.dumps(config))
    assert main(["replica", "--port", "0", "--no-auth", "--model", str(directory)]) == 1
    assert "quant_method 'fp8'" in _error_line(capsys.readouterr().err)


def _error_line(stderr: str) -> str:
    """The one `aigw: ` line (the load's progress bar may come before it), no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("aigw: ")]
    assert len(lines) == 1, stderr
    return lines[0]


# ---- GGUF --------------------------------------------------------------------------------------
def test_ggml_mxfp4_bytes_written_here_dequantize_in_gguf_to_the_hf_values() -> None:
    """The test's GGUF writer is checked against gguf's own MXFP4 dequantizer (llama.cpp's
    format)."""
    import gguf

    from engine.layers.mxfp4 import dequantize_mxfp4, quantize_mxfp4
    from tests.engine.models._gpt_oss import hf_mxfp4_to_ggml

    blocks, scales = quantize_mxfp4(torch.randn(3, 8, 96))
    ggml = hf_mxfp4_to_ggml(blocks, scales)
    theirs = gguf.quants.dequantize(ggml, gguf.GGMLQuantizationType.MXFP4)
    assert torch.equal(torch.from_numpy(theirs), dequantize_mxfp4(blocks, scales))


def test_gguf_file_loads_as_its_hf_directory_and_generates_transformers_tokens(
        gpt_oss_checkpoints: dict[str, GptOssCheckpoint], reference: dict, tmp_path: Path) -> None:
    from tests.engine.models._gpt_oss import write_gguf

    checkpoint = gpt_oss_checkpoints["mxfp4"]
    path = tmp_path / "tiny-gpt-oss.MXFP4.gguf"
    write_gguf(checkpoint.directory, path)
    from_gguf = load_checkpoint(str(path), progress=False)
    from_hf = load_checkpoint(str(checkpoint.directory), progress=False)
    assert from_gguf.config.architecture == "gpt_oss"
    assert from_gguf.config.layer_types == from_hf.config.layer_types
    assert from_gguf.config.rope_scaling == from_hf.config.rope_scaling
    assert from_gguf.weights.keys() == from_hf.weights.keys()
    for name, tensor in from_hf.weights.items():
        assert torch.equal(from_gguf.weights[name], tensor), name
    prompts = list(PROMPTS.values())
    tokens, logits = greedy(make_runner(from_gguf.config, from_gguf.weights), prompts,
                            NUM_NEW_TOKENS)
    for i, p in enumerate(PROMPTS):
        assert tokens[i] == reference["mxfp4"][p][0], p


# ---- the released config ----------------------------------------------------------------------
RELEASED_20B = {  # openai/gpt-oss-20b config.json (transformers 4.55 keys)
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_size": 2880, "initial_context_length": 4096,
    "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss",
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "pad_token_id": 199999,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    "rms_norm_eps": 1e-05, "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "tie_word_embeddings": False, "vocab_size": 201088}


def test_the_released_20b_config_maps_to_its_architecture(tmp_path: Path) -> None:
    import json

    from engine.layers.rotary import RotaryEmbedding
    from engine.loader.hf_checkpoint import model_config_from_hf

    (tmp_path / "config.json").write_text(json.dumps(RELEASED_20B))
    config = model_config_from_hf(tmp_path)
    assert ((config.architecture, config.num_experts, config.num_experts_per_tok)
            == ("gpt_oss", 32, 4))
    assert (config.moe_intermediate_size, config.head_dim, config.num_kv_heads) == (2880, 64, 8)
    assert [config.layer_sliding_window(i) for i in range(4)] == [128, None, 128, None]
    assert ((config.swiglu_limit, config.swiglu_alpha, config.eos_token_ids)
            == (7.0, 1.702, (200002,)))
    rotary = RotaryEmbedding(64, 8, config.rope_theta, dict(config.rope_scaling))
    assert float(rotary.cos[0, 0]) == pytest.approx(0.1 * torch.log(torch.tensor(32.0)).item() + 1)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_cos_sin_equal_transformers_gpt_oss_rotary_bit_for_bit(truncate: bool) -> None:
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from engine.layers.rotary import RotaryEmbedding

    scaling = {**RELEASED_20B["rope_scaling"], "truncate": truncate}
    config = transformers.GptOssConfig(head_dim=64, max_position_embeddings=131072,
                                       rope_parameters={**scaling, "rope_theta": 150000.0})
    positions = torch.arange(0, 9000, 7)
    cos, sin = GptOssRotaryEmbedding(config)(torch.zeros(1), positions[None])  # [1, P, Dh/2]
    ours = RotaryEmbedding(64, 9000, 150000.0, dict(scaling))
    our_cos, our_sin = ours.lookup(positions)  # [P, 1, Dh]: the two halves repeat
    assert torch.equal(our_cos[:, 0, :32], cos[0]) and torch.equal(our_sin[:, 0, :32], sin[0])
    assert torch.equal(our_cos[:, 0, 32:], cos[0])
