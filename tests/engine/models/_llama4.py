"""Tiny random Llama 4 text checkpoints written by transformers' save_pretrained
(Llama4ForCausalLM), with a byte-level BPE tokenizer and a Llama-4-style chat template, once per
test session.

    both: 4 layers, layers 0, 1, 3 RoPE with chunked attention (chunk 24, not a multiple of the
          16-token block) and layer 2 NoPE (global, temperature tuning with floor_scale 8 and
          attn_scale 0.5, so the query scale changes every 8 positions); 4 query heads over 2 kv
          heads of 16; L2 q/k norm; untied lm head; llama3 rope scaling; every norm weight random
    "dense": every layer a dense MLP of intermediate_size_mlp 96
    "moe":   layers 1 and 3 MoE (interleave_moe_layer_step 2): 4 experts of 48, top-1 sigmoid
             router, a shared expert of 48; layers 0 and 2 dense
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.models._checkpoints import randomize_norms, write_bpe_tokenizer
from tests.engine.models._qwen3 import TinyCheckpoint

VOCAB_SIZE = 320
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>",
            "<|finetune_right_pad|>"]
CHUNK_SIZE = 24
NO_ROPE_LAYERS = [1, 1, 0, 1]  # transformers' name: 1 = the layer uses RoPE
LLAMA4_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|header_start|>' + message['role'] + '<|header_end|>\\n\\n' + message['content'] | trim "
    "}}{{ '<|eot|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|header_start|>assistant<|header_end|>\\n\\n' }}{% endif "
    "%}")
VARIANTS = ("dense", "moe")


def write_tokenizer(directory: Path) -> dict[str, int]:
    """A byte-level BPE as tokenizer.json + tokenizer_config.json; -> special token ids by name."""
    return write_bpe_tokenizer(directory, SPECIALS, VOCAB_SIZE, bos_token="<|begin_of_text|>",
                               eos_token="<|eot|>", pad_token="<|finetune_right_pad|>",
                               chat_template=LLAMA4_TEMPLATE)


def make_config(variant: str, ids: dict[str, int]):  # type: ignore[no-untyped-def]
    import transformers

    return transformers.Llama4TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=48, intermediate_size_mlp=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, initializer_range=0.05, rms_norm_eps=1e-5,
        num_local_experts=4, num_experts_per_tok=1,
        moe_layers=[] if variant == "dense" else None, interleave_moe_layer_step=2,
        no_rope_layers=list(NO_ROPE_LAYERS), attention_chunk_size=CHUNK_SIZE, use_qk_norm=True,
        attn_temperature_tuning=True, floor_scale=8, attn_scale=0.5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
        tie_word_embeddings=False, pad_token_id=ids["<|finetune_right_pad|>"],
        bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=[ids["<|end_of_text|>"], ids["<|eot|>"]])


def write_checkpoints(root: Path) -> dict[str, TinyCheckpoint]:
    import transformers

    out = {}
    for variant in VARIANTS:
        directory = root / variant
        directory.mkdir()
        config = make_config(variant, write_tokenizer(directory))
        torch.manual_seed(0)
        model = transformers.Llama4ForCausalLM(config).to(torch.float32).eval()
        randomize_norms(model, 1.0)  # norms start at 1
        model.save_pretrained(directory)
        out[variant] = TinyCheckpoint(f"llama4-{variant}", directory, model)
    return out


@pytest.fixture(scope="session")
def llama4_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyCheckpoint]:
    return write_checkpoints(tmp_path_factory.mktemp("llama4"))
