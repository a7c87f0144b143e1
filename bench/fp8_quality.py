"""FP8 weights on the default model: memory saved and quality lost, against float32 (CPU, ~1-2
minutes).

    python -m bench.fp8_quality [--threads 2] [--max-tokens 32]

Prints the weight memory (every LinearWeight's nbytes plus embeddings and norms, tied tensors
counted once) in float32, bfloat16 (computed: 2 bytes per dense weight) and FP8; then, over 20
varied prompts, the greedy-token agreement of FP8 with float32 (identical continuations, mean
agreeing prefix, matching positions) and the mean KL(float32 || FP8) of the next-token
distributions along the float32 continuation (teacher-forced, so both models see the same
contexts).
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.batch import ScheduledBatch, ScheduledSequence
from engine.config import CacheConfig, EngineConfig
from engine.layers.linear import LinearWeight
from engine.model_runner import ModelRunner
from engine.models.llama import DecoderLayer, DenseMLP

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the ocean.",
    "def fibonacci(n):",
    "Explain how a transistor works in simple terms.",
    "List three fruits that are red:",
    "Translate to German: The weather is nice today.",
    "Once upon a time, in a small village,",
    "What is 17 multiplied by 23?",
    "The theory of relativity states that",
    "SELECT name, age FROM users WHERE",
    "My favourite recipe for pancakes is",
    "Give me a motivational quote for Monday morning.",
    "import numpy as np\nx = np.linspace(0, 1, 100)\n",
    "The three laws of thermodynamics are",
    "Dear hiring manager, I am writing to apply for",
    "Photosynthesis converts sunlight into",
    "A good name for a pet goldfish would be",
    "The stock market crashed in 1929 because",
    "How do I reverse a linked list in Python?",
    "In the year 2050, cities will",
]
BLOCK_SIZE = 16


def make_runner(checkpoint, quantization: str | None, threads: int) -> ModelRunner:  # type: ignore[no-untyped-def]
    config = EngineConfig(model_path="<bench>", num_threads=threads, dtype="float32",
                          quantization=quantization,
                          cache=CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory_bytes=256 << 20,
                                            enable_prefix_caching=False))
    return ModelRunner(config, checkpoint.config, dict(checkpoint.weights), dict(checkpoint.raw))


def weight_bytes(runner: ModelRunner, dense_bytes_per_weight: int | None = None) -> int:
    """Bytes of every weight the model holds; tied tensors once. `dense_bytes_per_weight` recounts
    dense tensors at that element size (bfloat16 = 2) without building the model in that dtype."""
    model = runner.model
    seen: set[int] = set()
    total = 0

    def add_tensor(t: torch.Tensor) -> None:
        nonlocal total
        if t.data_ptr() in seen:
            return
        seen.add(t.data_ptr())
        total += t.numel() * (dense_bytes_per_weight or t.element_size())

    def add_linear(linear: LinearWeight) -> None:
        nonlocal total
        weight = getattr(linear, "weight", None)
        if isinstance(weight, torch.Tensor):
            add_tensor(weight)
        else:
            total += linear.nbytes

    add_tensor(model.embed_tokens)
    add_tensor(model.norm)
    add_linear(model.lm_head)
    for layer in model.layers:
        for norm in (layer.input_norm, layer.post_attention_norm, layer.q_norm, layer.k_norm):
            if norm is not None:
                add_tensor(norm)
        for linear in _linears(layer):
            add_linear(linear)
    return total


def _linears(layer: DecoderLayer) -> list[LinearWeight]:
    assert isinstance(layer.mlp, DenseMLP), "the default model is dense"
    return [layer.qkv, layer.o_proj, layer.mlp.gate_up, layer.mlp.down]


def greedy(runner: ModelRunner, prompts: list[list[int]], num_new_tokens: int,
           forced: list[list[int]] | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """All prompts in one batch: (new tokens, logits [num_new_tokens, vocab]) per prompt."""
    tokens = [list(p) for p in prompts]
    new: list[list[int]] = [[] for _ in prompts]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    num_blocks = (max(map(len, prompts)) + num_new_tokens) // BLOCK_SIZE + 1
    for step in range(num_new_tokens):
        seqs = [ScheduledSequence(str(i), t if step == 0 else t[-1:],
                                  0 if step == 0 else len(t) - 1,
                                  list(range(i * num_blocks, (i + 1) * num_blocks)), True)
                for i, t in enumerate(tokens)]
        out = runner.execute(ScheduledBatch(seqs))
        for request_id, row in zip(out.request_ids, out.logits, strict=True):
            i = int(request_id)
            token = forced[i][step] if forced is not None else int(row.argmax())
            rows[i].append(row.float())
            new[i].append(token)
            tokens[i].append(token)
    return new, [torch.stack(r) for r in rows]


def mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over rows of KL(softmax(reference) || softmax(other)), rows [N, vocab]."""
    ref = torch.log_softmax(reference.double(), dim=-1)
    oth = torch.log_softmax(other.double(), dim=-1)
    return float((ref.exp() * (ref - oth)).sum(-1).mean())


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from engine.loader import default_model_path, load_checkpoint, load_tokenizer

    start = time.perf_counter()
    path = default_model_path()
    checkpoint = load_checkpoint(str(path), dtype=torch.float32, progress=False)
    tokenizer = load_tokenizer(path)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    fp32 = make_runner(checkpoint, None, args.threads)
    fp8 = make_runner(checkpoint, "fp8", args.threads)

    mib = 2**20
    print(f"model: {path.name}  ({len(PROMPTS)} prompts x {args.max_tokens} greedy tokens)")
    print(f"weights float32 : {weight_bytes(fp32) / mib:8.1f} MiB")
    print(f"weights bfloat16: {weight_bytes(fp32, 2) / mib:8.1f} MiB  (computed)")
    print(f"weights fp8     : {weight_bytes(fp8) / mib:8.1f} MiB  (linears FP8 + scales; "
          f"embeddings, norms, lm_head float32)")
    print(f"weights fp8 (bf16 rest): {(weight_bytes(fp8) - _float32_rest(fp8) / 2) / mib:8.1f} "
          "MiB  (computed)")

    ref_tokens, ref_logits = greedy(fp32, prompts, args.max_tokens)
    fp8_tokens, _ = greedy(fp8, prompts, args.max_tokens)
    _, forced_logits = greedy(fp8, prompts, args.max_tokens, forced=ref_tokens)
    identical = sum(a == b for a, b in zip(ref_tokens, fp8_tokens, strict=True))
    prefix = [common_prefix(a, b) for a, b in zip(ref_tokens, fp8_tokens, strict=True)]
    positions = sum(x == y for a, b in zip(ref_tokens, fp8_tokens, strict=True)
                    for x, y in zip(a, b, strict=True))
    kls = [mean_kl(r, f) for r, f in zip(ref_logits, forced_logits, strict=True)]
    top1 = sum(int((r.argmax(-1) == f.argmax(-1)).sum())
               for r, f in zip(ref_logits, forced_logits, strict=True))
    total = len(prompts) * args.max_tokens
    print(f"identical continuations : {identical}/{len(prompts)}")
    print(f"mean agreeing prefix    : {sum(prefix) / len(prefix):.1f} / {args.max_tokens} tokens")
    print(f"matching positions      : {positions}/{total} ({100 * positions / total:.1f}%)")
    print(f"teacher-forced top-1    : {top1}/{total} ({100 * top1 / total:.1f}%)")
    print(f"mean KL(fp32 || fp8)    : {sum(kls) / len(kls):.5f} nats (max per prompt "
          f"{max(kls):.5f})")
    print(f"[{time.perf_counter() - start:.0f} s]")


def _float32_rest(runner: ModelRunner) -> int:
    """Bytes of the float32 tensors (embeddings, norms, lm_head) of an FP8 model, tied once."""
    linear_bytes = [linear.nbytes for layer in runner.model.layers for linear in _linears(layer)]
    return weight_bytes(runner) - sum(linear_bytes)


if __name__ == "__main__":
    main()
