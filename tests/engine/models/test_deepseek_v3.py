"""DeepSeek-V3 through the engine matches transformers' DeepseekV3: greedy tokens equal and logprobs
within 2e-3 (float32), with q LoRA and interleaved rope and with a plain q_proj and rotate-half
rope; the same tokens alone and among 8 concurrent requests with chunked prefill, after a
prefix-cache hit and after preemption, with no KV block leaked; the KV cache holds only the latent
(one vector of kv_lora_rank + qk_rope_head_dim per token and layer)."""

from __future__ import annotations

import functools
import json
import random
import shutil
from pathlib import Path

import pytest

from contracts.sampling_params import SamplingParams
from engine.loader.hf_checkpoint import model_config_from_hf
from engine.models.deepseek_v3 import kv_bytes_per_token_mla_and_full, mla_softmax_scale
from tests.engine.fakes import assert_idle_and_clean, generate
from tests.engine.models import _serving_checks as serving
from tests.engine.models._deepseek_v3 import DeepseekCheckpoint
from tests.engine.models._greedy import hf_greedy

NUM_NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=True)
_rng = random.Random(11)
PROMPTS = {f"p{n}": [_rng.randrange(0, 300) for _ in range(n)] for n in (19, 29, 41)}


make_engine = functools.partial(serving.make_engine, kv_cache_memory_bytes=8 << 20)  # overridable


@pytest.fixture(scope="module")
def reference(deepseek_v3_checkpoints: dict[str,
                                            DeepseekCheckpoint]) -> dict[str, dict[str, tuple]]:
    """transformers' (tokens, logprobs) per checkpoint and prompt."""
    return {name: {p: hf_greedy(checkpoint.model, prompt, NUM_NEW_TOKENS)
                   for p, prompt in PROMPTS.items()}
            for name, checkpoint in deepseek_v3_checkpoints.items()}


@pytest.mark.parametrize("name", ["lora", "plain_q"])
def test_engine_generates_transformers_greedy_tokens_and_logprobs(
        name: str, deepseek_v3_checkpoints: dict[str, DeepseekCheckpoint], reference: dict) -> None:
    engine = make_engine(deepseek_v3_checkpoints[name].directory)
    serving.check_greedy_parity(engine, PROMPTS, reference[name], GREEDY)


def test_the_kv_cache_holds_one_latent_vector_per_token_and_layer(
        deepseek_v3_checkpoints: dict[str, DeepseekCheckpoint]) -> None:
    engine = make_engine(deepseek_v3_checkpoints["lora"].directory)
    runner = engine.runner
    hf_config = deepseek_v3_checkpoints["lora"].model.config
    latent = hf_config.kv_lora_rank + hf_config.qk_rope_head_dim  # 32 + 8
    for k_cache, v_cache in runner.kv_caches:
        assert k_cache is v_cache  # K and V are the one latent tensor
        assert tuple(k_cache.shape[1:]) == (16, 1, latent)
    assert runner.bytes_per_block == hf_config.num_hidden_layers * 16 * latent * 4  # float32


def test_the_softmax_scale_is_transformers_yarn_mscale_scale(
        deepseek_v3_checkpoints: dict[str, DeepseekCheckpoint]) -> None:
    """mscale_all_dim 1 at factor 40 scales the softmax by (0.1 ln 40 + 1)^2 = 1.87: the parity
    above would fail without it."""
    checkpoint = deepseek_v3_checkpoints["lora"]
    ours = mla_softmax_scale(model_config_from_hf(checkpoint.directory))
    theirs = checkpoint.model.model.layers[0].self_attn.scaling
    assert ours == pytest.approx(theirs, rel=1e-12)
    assert ours > 1.8 * (16 + 8) ** -0.5


def test_tokens_alone_equal_tokens_among_8_concurrent_requests_with_chunked_prefill(
        deepseek_v3_checkpoints: dict[str, DeepseekCheckpoint], reference: dict) -> None:
    """A 16-token step budget splits every prompt over several steps while others decode."""
    engine = make_engine(deepseek_v3_checkpoints["lora"].directory, max_num_batched_tokens=16,
                         enable_prefix_caching=False)
    target = PROMPTS["p41"]
    others = {f"o{i}": [_rng.randrange(0, 300) for _ in range(9 + 5 * i)] for i in range(8)}
    serving.check_target_among_8_concurrent(engine, target, others, reference["lora"]["p41"][0],
                                            GREEDY)


def test_a_prefix_cache_hit_continues_with_the_same_tokens(
        deepseek_v3_checkpoints: dict[str, DeepseekCheckpoint], reference: dict) -> None:
    checkpoint = deepseek_v3_checkpoints["lora"]
    engine = make_engine(checkpoint.directory)  # blocks of latents
    serving.check_prefix_cache_hit(engine, checkpoint.model, PROMPTS["p41"],
                                   reference["lora"]["p41"][0], GREEDY)


def test_outputs_after_preemption_equal_outputs_with_room(
        deepseek_v3_checkpoints: dict[str, DeepseekCheckpoint], reference: dict) -> None:
    """A cache of 4 blocks (64 tokens) holds the longest request (41 + 10) alone, not all three."""
    directory = deepseek_v3_checkpoints["lora"].directory
    bytes_per_block = make_engine(directory).runner.bytes_per_block
    tight = make_engine(directory, kv_cache_memory_bytes=4 * bytes_per_block,
                        max_num_batched_tokens=16)
    out = generate(tight, PROMPTS, GREEDY)
    assert tight.stats().num_preemptions_total > 0
    for p in PROMPTS:
        assert out[p].token_ids == reference["lora"][p][0], p
    assert_idle_and_clean(tight)


# ---- the released config: KV bytes, and what is refused in one line ----------------------------
RELEASED_V3 = {  # deepseek-ai/DeepSeek-V3 config.json, the fields the engine reads
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_nextn_predict_layers": 1, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}


def test_deepseek_v3_671b_caches_70_kb_per_token_in_bf16_not_4_8_mb(tmp_path: Path) -> None:
    """The released config (FP8 block-scaled weights:
    tests/engine/models/test_fp8_block_checkpoints.py)."""
    (tmp_path / "config.json").write_text(json.dumps(RELEASED_V3))
    config = model_config_from_hf(tmp_path)
    assert (config.num_kv_heads, config.head_dim, config.mlp_only_layers) == (1, 576, (0, 1, 2))
    latent, full = kv_bytes_per_token_mla_and_full(config, element_size=2)
    assert latent == 61 * 576 * 2 == 70_272
    assert full == 61 * 128 * (192 + 128) * 2 == 4_997_120  # per head K (nope + rope) and V
    from engine.kv_cache.layout import kv_bytes_per_token

    assert kv_bytes_per_token(config, 2) * config.num_layers == latent  # what the cache allocates


@pytest.mark.parametrize(("edit", "named"), [
    (lambda c: c.update(quantization_config={"quant_method": "awq"}), "quant_method 'awq'"),
    (lambda c: c.update(quantization_config={"quant_method": "fp8"}), "without weight_block_size"),
    (lambda c: c.update(scoring_func="softmax"), "scoring_func 'softmax'"),
    (lambda c: c.update(topk_method="greedy"), "topk_method 'greedy'"),
], ids=["awq", "fp8_per_tensor", "softmax_scores", "greedy_topk"])
def test_an_unsupported_config_is_one_error_line(
        edit, named: str, deepseek_v3_checkpoints: dict[str, DeepseekCheckpoint], tmp_path: Path,  # type: ignore[no-untyped-def]
        capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    directory = tmp_path / "unsupported"
    shutil.copytree(deepseek_v3_checkpoints["plain_q"].directory, directory)
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))
    assert main(["replica", "--port", "0", "--no-auth", "--model", str(directory)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("aigw: ")]
    assert len(lines) == 1 and named in lines[0], err


def test_a_missing_tensor_is_one_error_line_naming_it(
        deepseek_v3_checkpoints: dict[str, DeepseekCheckpoint], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from engine.loader import load_checkpoint
    from engine.models.weights import CheckpointMismatchError
    from tests.engine.models._greedy import make_runner

    directory = tmp_path / "broken"
    shutil.copytree(deepseek_v3_checkpoints["lora"].directory, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    tensors.pop("model.layers.2.mlp.gate.e_score_correction_bias")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    checkpoint = load_checkpoint(str(directory), progress=False)
    with pytest.raises(CheckpointMismatchError,
                       match=r"'model\.layers\.2\.mlp\.gate\.e_score_correction_bias'"):
        make_runner(checkpoint.config, checkpoint.weights)
