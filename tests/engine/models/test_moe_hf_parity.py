"""Tiny random MoE checkpoints written by transformers' save_pretrained load into our engine and
match transformers token for token (greedy) and logit for logit (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.loader import load_checkpoint
from tests.engine.models._checkpoints import FAMILIES, write_checkpoint
from tests.engine.models._greedy import greedy, make_runner

NUM_NEW_TOKENS = 16
PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 200], [1, 2, 3]]


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: list[int],
              num_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt])
    rows = []
    for _ in range(num_new_tokens):
        last = model(input_ids=ids).logits[0, -1].float()  # [vocab]
        rows.append(last)
        ids = torch.cat([ids, last.argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist(), torch.stack(rows)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_matches_transformers_tokens_and_logits(family: str, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model = write_checkpoint(family, tmp_path)
    checkpoint = load_checkpoint(str(tmp_path), dtype=torch.float32, progress=False)
    assert checkpoint.config.architecture == family.split("-")[0]
    assert checkpoint.config.is_moe
    runner = make_runner(checkpoint.config, checkpoint.weights)

    ours, our_logits = greedy(runner, PROMPTS, NUM_NEW_TOKENS)
    for i, prompt in enumerate(PROMPTS):
        theirs, their_logits = hf_greedy(model, prompt, NUM_NEW_TOKENS)
        assert ours[i] == theirs, f"prompt {i}: greedy tokens differ"
        assert len(set(theirs)) > 1, "degenerate model: every new token is the same"
        assert relative_error(our_logits[i][-1], their_logits[-1]) < 1e-4
        assert relative_error(our_logits[i], their_logits) < 1e-4


def test_fused_expert_layout_of_transformers_5_modules_loads_the_same(tmp_path: Path) -> None:
    """transformers 5 holds experts fused in memory (mlp.experts.gate_up_proj [E, 2I, H], down_proj
    [E, H, I], router mlp.gate) while save_pretrained writes the per-expert Hub layout: both
    load."""
    torch.set_num_threads(1)
    model = write_checkpoint("mixtral", tmp_path)
    checkpoint = load_checkpoint(str(tmp_path), dtype=torch.float32, progress=False)
    in_memory = {name: t.detach().clone() for name, t in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in in_memory
    from_file, file_logits = greedy(make_runner(checkpoint.config, checkpoint.weights), PROMPTS, 4)
    fused, fused_logits = greedy(make_runner(checkpoint.config, in_memory), PROMPTS, 4)
    assert fused == from_file
    for a, b in zip(fused_logits, file_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_every_expert_router_and_shared_expert_weight_is_consumed(tmp_path: Path) -> None:
    from engine.layers.linear import DenseLinear
    from engine.layers.torch_attention import TorchPagedAttention
    from engine.models.registry import build_model

    write_checkpoint("qwen2_moe-shared", tmp_path)
    checkpoint = load_checkpoint(str(tmp_path), dtype=torch.float32, progress=False)
    weights = dict(checkpoint.weights)
    build_model(checkpoint.config, weights, TorchPagedAttention(), lambda name, w: DenseLinear(w))
    assert weights == {}
