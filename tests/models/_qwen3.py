"""Tiny random Qwen3 / Qwen3-MoE checkpoints written by transformers' save_pretrained, with a small
byte-level BPE tokenizer (ChatML specials), once per test session; and transformers' greedy run.

Variants (each a directory under one session tmp dir):
    qwen3              dense; head_dim 32 != hidden / heads (16); tied embeddings
    qwen3_moe          8 experts, top-2, norm_topk_prob on, mlp_only_layers [1]: layers 0, 2 sparse
    qwen3_moe-step2    8 experts, top-2, norm_topk_prob off, decoder_sparse_step 2: layers 1, 3 sparse
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

VOCAB_SIZE = 320  # the tokenizer's 256 bytes + merges + 3 specials fit in it
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
          " + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "tell me one fact about the moon and the sea",
          "def prime(n): return all(n % d for d in range(2, n))", "bread, jazz, chess, rain, bees"]

COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=512, initializer_range=0.3,
              rms_norm_eps=1e-6, pad_token_id=None, bos_token_id=None)


def make_config(name: str, eos_id: int | None = None):  # type: ignore[no-untyped-def]
    """The transformers config of variant `name` (module docstring)."""
    import transformers

    if name == "qwen3":
        return transformers.Qwen3Config(**COMMON, num_hidden_layers=2, eos_token_id=eos_id,
                                        tie_word_embeddings=True)
    moe = dict(COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               eos_token_id=eos_id, tie_word_embeddings=False)
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**moe, num_hidden_layers=3, norm_topk_prob=True,
                                           mlp_only_layers=[1])
    assert name == "qwen3_moe-step2"
    return transformers.Qwen3MoeConfig(**moe, num_hidden_layers=4, norm_topk_prob=False,
                                       decoder_sparse_step=2)


VARIANTS = ("qwen3", "qwen3_moe", "qwen3_moe-step2")


@functools.cache
def _trained_tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    assert tokenizer.get_vocab_size() <= VOCAB_SIZE
    return tokenizer


def write_tokenizer(directory: Path) -> int:
    """A byte-level BPE (vocab <= VOCAB_SIZE) as tokenizer.json + tokenizer_config.json; -> eos id."""
    tokenizer = _trained_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}))
    return int(tokenizer.token_to_id("<|im_end|>"))


@dataclass
class TinyCheckpoint:
    name: str
    directory: Path
    model: torch.nn.Module  # transformers' own, float32, eval mode


def write_checkpoints(root: Path) -> dict[str, TinyCheckpoint]:
    import transformers

    out = {}
    for name in VARIANTS:
        directory = root / name
        directory.mkdir()
        config = make_config(name, eos_id=write_tokenizer(directory))
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():  # norms start at 1: make each one's weights matter (q vs k, per head)
            for param_name, param in model.named_parameters():
                if param_name.endswith("norm.weight"):
                    param.copy_(1 + 0.5 * torch.randn_like(param))
        model.save_pretrained(directory)
        out[name] = TinyCheckpoint(name, directory, model)
    return out


@pytest.fixture(scope="session")
def qwen3_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyCheckpoint]:
    return write_checkpoints(tmp_path_factory.mktemp("qwen3"))


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: list[int], num_new_tokens: int
              ) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation (full recompute each step) and each new token's logprob."""
    ids = torch.tensor([prompt])
    tokens, logprobs = [], []
    for _ in range(num_new_tokens):
        last = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), dim=-1)  # [vocab]
        token = int(last.argmax())
        tokens.append(token)
        logprobs.append(float(last[token]))
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, logprobs
