"""engine.testing.build_random_engine (bench/gpu_check.py's end-to-end hook) on a tiny Mixtral
shape."""

from __future__ import annotations

import pytest

from engine.config import ModelConfig
from engine.layers.fp8_linear import FP8Linear
from engine.testing import build_random_engine

TINY = ModelConfig(architecture="mixtral", vocab_size=128, hidden_size=32, intermediate_size=48,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                   max_position_embeddings=256, num_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=48)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_random_engine_generates_max_tokens_for_every_prompt(quantization: str | None) -> None:
    engine = build_random_engine("mixtral", quantization=quantization, device="cpu",
                                 model_config=TINY)
    prompts = [[1, 2, 3, 4, 5], list(range(10, 40)), [7]]
    outs = engine.generate(prompts, max_tokens=6)
    assert [len(o.token_ids) for o in outs] == [6, 6, 6]
    assert all(0 <= t < TINY.vocab_size for o in outs for t in o.token_ids)
    again = engine.generate(prompts[:1], max_tokens=6)  # greedy: the same continuation again
    assert again[0].token_ids == outs[0].token_ids
    assert (isinstance(engine.engine.runner.model.layers[0].o_proj, FP8Linear)
            == (quantization == "fp8"))


def test_random_engine_rejects_a_config_of_another_architecture() -> None:
    with pytest.raises(ValueError, match="asked for 'mixtral'"):
        build_random_engine("mixtral", device="cpu", model_config=TINY.__class__(
            **{**TINY.__dict__, "architecture": "llama", "num_experts": 0,
               "num_experts_per_tok": 0}))
