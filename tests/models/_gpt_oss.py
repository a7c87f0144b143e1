"""Tiny random gpt-oss checkpoints, written once per test session, and transformers' greedy reference.

    dense   transformers' save_pretrained of a seeded random GptOssForCausalLM: 4 layers (sliding, full,
            sliding, full), sliding_window 8, YaRN as the released config has it (factor 32, beta 32/1,
            truncate off), 4 experts top-2, hidden 64, expert size 32, 4 query heads over 2 kv heads
            of 16, large learned sinks; byte-level BPE tokenizer with the harmony specials
    mxfp4   the same model with its expert weights quantized to MXFP4 and stored as the released
            openai/gpt-oss-* files store them (*_blocks uint8 [E, N, K/32, 16], *_scales uint8
            [E, N, K/32], quantization_config.quant_method "mxfp4"); its reference is transformers'
            own reading of that directory (Mxfp4Config(dequantize=True))
    twin    the mxfp4 model's dequantized weights, written dense by save_pretrained
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

VOCAB_SIZE = 320
SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
            "<|call|>"]
CORPUS = ["the quick brown fox jumps over the lazy dog", "tell me one fact about the moon and the sea",
          "def prime(n): return all(n % d for d in range(2, n))", "bread, jazz, chess, rain, bees"]
SLIDING_WINDOW = 8
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 150000.0}
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def make_config(eos_id: int | None):  # type: ignore[no-untyped-def]
    import transformers

    return transformers.GptOssConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=SLIDING_WINDOW, max_position_embeddings=64 * 32,
        initializer_range=0.3, rope_parameters=dict(YARN), eos_token_id=eos_id, pad_token_id=None,
        bos_token_id=None)


def write_tokenizer(directory: Path) -> int:
    """A byte-level BPE (vocab <= VOCAB_SIZE) as tokenizer.json + tokenizer_config.json; -> eos id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    assert tokenizer.get_vocab_size() <= VOCAB_SIZE
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|return|>", "pad_token": "<|endoftext|>"}))
    return int(tokenizer.token_to_id("<|return|>"))


@dataclass
class GptOssCheckpoint:
    name: str
    directory: Path
    model: torch.nn.Module  # transformers' own reading, float32, eval mode


def quantize_experts(directory: Path) -> None:
    """Rewrite `directory`'s dense expert tensors as MXFP4 blocks + scales, config.json to match."""
    from safetensors.torch import load_file, save_file

    from engine.layers.mxfp4 import quantize_mxfp4

    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))  # [E, K, N] -> rows N
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, str(file), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (directory / "config.json").write_text(json.dumps(config))


def write_checkpoints(root: Path) -> dict[str, GptOssCheckpoint]:
    import transformers

    out = {}
    for name in ("dense", "mxfp4", "twin"):
        (root / name).mkdir()
    eos_id = write_tokenizer(root / "dense")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config(eos_id), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:  # sinks that take a visible share of each softmax
            layer.self_attn.sinks.normal_(0.0, 2.0)
    model.eval().save_pretrained(root / "dense")
    out["dense"] = GptOssCheckpoint("dense", root / "dense", model)

    model.save_pretrained(root / "mxfp4")
    quantize_experts(root / "mxfp4")
    write_tokenizer(root / "mxfp4")
    dequantized = transformers.GptOssForCausalLM.from_pretrained(
        root / "mxfp4", quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32).eval()
    out["mxfp4"] = GptOssCheckpoint("mxfp4", root / "mxfp4", dequantized)
    dequantized.save_pretrained(root / "twin")
    config = json.loads((root / "twin" / "config.json").read_text())
    config.pop("quantization_config", None)
    (root / "twin" / "config.json").write_text(json.dumps(config))
    write_tokenizer(root / "twin")
    out["twin"] = GptOssCheckpoint("twin", root / "twin", dequantized)
    return out


@pytest.fixture(scope="session")
def gpt_oss_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, GptOssCheckpoint]:
    torch.set_num_threads(1)
    return write_checkpoints(tmp_path_factory.mktemp("gpt_oss"))


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
