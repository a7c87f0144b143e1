"""A tiny random Gemma 3 text checkpoint written by transformers' save_pretrained
(Gemma3ForCausalLM), with a byte-level BPE tokenizer and a Gemma-style chat template, once per test
session.

    4 layers: local (sliding window 20), local, global, local; 4 query heads over 2 kv heads of 32
    (head_dim != hidden / heads); query_pre_attn_scalar 24 (not head_dim); local rope base 100,
    global base 10,000 with linear scaling x2; final_logit_softcapping 3 (binding: the random
    model's logits exceed it); initializer_range 0.05 (larger ones repeat one token); tied
    embeddings; every norm weight random (Gemma's init is zeros)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.models._checkpoints import randomize_norms, write_bpe_tokenizer
from tests.engine.models._qwen3 import TinyCheckpoint

VOCAB_SIZE = 320
SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
SLIDING_WINDOW = 20
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
# Gemma 3's template shape: bos, the system text folded into the first user turn, "model" as the
# assistant's role, strict alternation
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = "
    "messages[1:] %}{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% "
    "endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")


def write_tokenizer(directory: Path) -> dict[str, int]:
    """A byte-level BPE as tokenizer.json + tokenizer_config.json; -> special token ids by name."""
    return write_bpe_tokenizer(directory, SPECIALS, VOCAB_SIZE, bos_token="<bos>",
                               eos_token="<eos>", pad_token="<pad>", chat_template=GEMMA_TEMPLATE)


def make_config(ids: dict[str, int]):  # type: ignore[no-untyped-def]
    import transformers

    return transformers.Gemma3TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        initializer_range=0.05, rms_norm_eps=1e-6, query_pre_attn_scalar=24,
        sliding_window=SLIDING_WINDOW, layer_types=list(LAYER_TYPES), rope_local_base_freq=100.0,
        rope_theta=10_000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
        final_logit_softcapping=3.0, tie_word_embeddings=True, pad_token_id=ids["<pad>"],
        bos_token_id=ids["<bos>"], eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]])


def write_checkpoint(directory: Path) -> TinyCheckpoint:
    import transformers

    config = make_config(write_tokenizer(directory))
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).to(torch.float32).eval()
    randomize_norms(model, 0.0)  # Gemma's norms start at 0 (scale 1 + w)
    model.save_pretrained(directory)
    return TinyCheckpoint("gemma3_text", directory, model)


@pytest.fixture(scope="session")
def gemma3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    return write_checkpoint(tmp_path_factory.mktemp("gemma3"))
