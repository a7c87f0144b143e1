"""Greedy decoding two ways: a ModelRunner driven directly (no scheduler, no tokenizer) with every
step's logits, and transformers' reference (`hf_greedy`)."""

from __future__ import annotations

import torch

from engine.batch import ScheduledBatch, ScheduledSequence
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.model_runner import ModelRunner

BLOCK_SIZE = 16


def make_runner(model_config: ModelConfig, weights: dict[str, torch.Tensor],
                quantization: str | None = None) -> ModelRunner:
    config = EngineConfig(model_path="<test>", num_threads=1, dtype="float32",
                          quantization=quantization,
                          cache=CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory_bytes=16 << 20,
                                            enable_prefix_caching=False))
    return ModelRunner(config, model_config, dict(weights))


def greedy(runner: ModelRunner, prompts: list[list[int]], num_new_tokens: int,
           forced: list[list[int]] | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill every prompt in one step, then decode them together.

    Returns (new tokens per prompt, logits [num_new_tokens, vocab] per prompt: the distribution each
    new token was drawn from). With `forced`, those tokens are fed instead of the argmax (teacher
    forcing).
    """
    tokens = [list(p) for p in prompts]
    new: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    num_blocks = (max(map(len, prompts)) + num_new_tokens) // BLOCK_SIZE + 1
    layout = getattr(runner, "kv_layout", None)
    # KV cache groups (sliding windows)
    num_groups = len(layout.groups) if layout is not None else 1
    tables = [[list(range((g * len(prompts) + i) * num_blocks,
                          (g * len(prompts) + i + 1) * num_blocks))
               # [prompt][group] -> blocks
               for g in range(num_groups)] for i in range(len(prompts))]
    for step in range(num_new_tokens):
        extra = [{"extra_block_tables": tuple(tables[i][1:])} if num_groups > 1 else {}
                 for i in range(len(prompts))]
        seqs = [ScheduledSequence(str(i), t if step == 0 else t[-1:],
                                  0 if step == 0 else len(t) - 1,
                                  tables[i][0], True, **extra[i]) for i, t in enumerate(tokens)]
        out = runner.execute(ScheduledBatch(seqs))
        for request_id, row in zip(out.request_ids, out.logits, strict=True):
            i = int(request_id)
            token = forced[i][step] if forced is not None else int(row.argmax())
            logits[i].append(row)
            new[i].append(token)
            tokens[i].append(token)
    return new, [torch.stack(rows) for rows in logits]


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
