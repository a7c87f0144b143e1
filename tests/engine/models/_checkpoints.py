"""Tiny random-weight MoE checkpoints of each family, written by transformers' save_pretrained; and
the small byte-level BPE every tiny checkpoint's tokenizer is trained from (`train_byte_bpe`,
saved beside a checkpoint by `write_bpe_tokenizer`), the norm weights every family's writer makes
random (`randomize_norms`), and the parts every test GGUF writer shares (`add_gguf_vocabulary`,
`finish_gguf`)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              tie_word_embeddings=False)

FAMILIES = {
    "mixtral": lambda: transformers.MixtralConfig(num_local_experts=8, num_experts_per_tok=2,
                                                  **COMMON),
    "qwen2_moe-shared": lambda: transformers.Qwen2MoeConfig(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False, **COMMON),
    "qwen2_moe-normalized-no-shared": lambda: transformers.Qwen2MoeConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=0, norm_topk_prob=True, **COMMON),
    # layer 0 dense, layer 1 sparse
    "qwen2_moe-mlp-only-layer-0": lambda: transformers.Qwen2MoeConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[0], **COMMON),
    "olmoe": lambda: transformers.OlmoeConfig(num_experts=8, num_experts_per_tok=2,
                                              norm_topk_prob=False, **COMMON),
}


def write_checkpoint(family: str, directory: Path,
                     initializer_range: float | None = None) -> torch.nn.Module:
    """Save a seeded random model of `family` into `directory`; returns the transformers model."""
    config = FAMILIES[family]()
    if initializer_range is not None:
        config.initializer_range = initializer_range
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    return model


CORPUS = ["the quick brown fox jumps over the lazy dog",
          "tell me one fact about the moon and the sea",
          "def prime(n): return all(n % d for d in range(2, n))", "bread, jazz, chess, rain, bees"]


@functools.cache
def train_byte_bpe(special_tokens: tuple[str, ...], vocab_size: int):  # type: ignore[no-untyped-def]
    """A byte-level BPE (tokenizers.Tokenizer) trained on CORPUS, vocab <= vocab_size, the specials
    first; cached: every caller gets the same object (save it, do not change it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    assert tokenizer.get_vocab_size() <= vocab_size
    return tokenizer


def write_bpe_tokenizer(directory: Path, specials: Sequence[str], vocab_size: int,
                        **tokenizer_config: Any) -> dict[str, int]:
    """`train_byte_bpe(specials, vocab_size)` saved as directory/tokenizer.json, and
    `tokenizer_config` as its tokenizer_config.json; -> the specials' ids by text."""
    tokenizer = train_byte_bpe(tuple(specials), vocab_size)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return {t: int(tokenizer.token_to_id(t)) for t in specials}


def randomize_norms(model: torch.nn.Module, center: float) -> None:
    """Every "*norm.weight" of `model` set to center + 0.5 * N(0, 1) (torch's global generator):
    an init's constant norms would hide a norm read wrong (q vs k, per head, 1 + w)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(center + 0.5 * torch.randn_like(param))


def add_gguf_vocabulary(writer: Any, tokenizer_json: dict, pre: str,
                        is_special: Callable[[str], bool],
                        num_tokens: int | None = None) -> dict[str, int]:
    """The byte-level BPE in `tokenizer_json` (a tokenizer.json, parsed) as llama.cpp writes a
    "gpt2" vocabulary: token list, types (3 control, 1 normal), merges. With `num_tokens` the list
    is padded to that many with "<|pad_{id}|>" for ids the BPE does not use. -> token ids by
    text."""
    model = tokenizer_json["model"]
    vocab = {**model["vocab"], **{t["content"]: t["id"] for t in tokenizer_json["added_tokens"]}}
    tokens = ([f"<|pad_{i}|>" for i in range(num_tokens)] if num_tokens is not None
              else [""] * len(vocab))
    for token, i in vocab.items():
        tokens[i] = token
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if is_special(t) else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    return vocab


def finish_gguf(writer: Any) -> None:
    """Write the header, metadata and tensors a GGUFWriter holds, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
