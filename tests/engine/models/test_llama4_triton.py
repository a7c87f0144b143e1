"""Llama 4's chunked local attention on the CUDA backend (here the Triton interpreter on CPU
tensors): the tiny MoE checkpoint (tests/engine/models/_llama4.py), its RoPE layers' chunk groups
and NoPE layer run through TritonPagedAttention, gives transformers' greedy tokens and logits
(float32) on a prompt several chunks long, prefilled in one step and decoded."""

from __future__ import annotations

import os

import pytest
import torch

from engine.layers.triton_attention import TritonPagedAttention
from engine.loader.hf_checkpoint import load_hf_checkpoint
from tests.engine.models._greedy import greedy, hf_greedy, make_runner
from tests.engine.models._llama4 import CHUNK_SIZE
from tests.engine.models._qwen3 import TinyCheckpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available()
                                and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs CUDA or TRITON_INTERPRET=1 (set by "
                                       "tests/conftest.py)")

NUM_NEW_TOKENS = 4


def test_triton_backend_runs_the_chunked_and_nope_layers_as_transformers_does(
        llama4_checkpoints: dict[str, TinyCheckpoint], monkeypatch: pytest.MonkeyPatch) -> None:
    source = llama4_checkpoints["moe"]
    checkpoint = load_hf_checkpoint(source.directory, progress=False)
    runner = make_runner(checkpoint.config, checkpoint.weights)
    assert len(runner.kv_layout.groups) == 4  # the NoPE layer's full group, three chunk groups
    monkeypatch.setattr("engine.kernels.FORCED_BACKEND", "triton")
    runner.model.attention = TritonPagedAttention()
    prompt = [(7 * i + 11) % 300 + 6 for i in range(3 * CHUNK_SIZE + 5)]
    expected, expected_logprobs = hf_greedy(source.model, prompt, NUM_NEW_TOKENS)
    (tokens,), (logits,) = greedy(runner, [prompt], NUM_NEW_TOKENS)
    assert tokens == expected
    logprobs = torch.log_softmax(logits.float(), dim=-1)[torch.arange(NUM_NEW_TOKENS), tokens]
    assert (logprobs - torch.tensor(expected_logprobs)).abs().max() < 2e-3
