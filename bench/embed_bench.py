"""`aigw bench embed`: embedding throughput (texts/s) of our embedder against transformers +
the model's pooling (what sentence-transformers runs: BertModel, mean/CLS pooling, Normalize;
its `encode` sorts texts by length and pads batches of 32) on the same CPU, in one run.

    aigw bench embed [--model PATH] [--threads 2] [--num-texts 512] [--concurrency 32]
                     [--plot PATH] [--json PATH] [--tiny]

Rows (each over the same seeded texts, ~10-120 words, tokenization included):
    one text a request, C requests in flight   ours: inputs of concurrent requests share passes
                                               baseline: one forward per text, in turn
    32 texts a request                         ours: one request of 32 at a time
                                               baseline: sentence-transformers' encode, batch 32
Also printed: the largest 1 - cosine between the two sides' vectors (they must agree, < 1e-5).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy is an engine dependency: imported where used, so `aigw` without
    import numpy as np  # the engine extra still lists this benchmark


WORDS = ("the gateway routes each request to a replica that holds its prefix in the paged cache "
         "while metering tokens per project and key with limits budgets retries failover streams "
         "embeddings vectors search documents retrieval chunk query answer model weights kernel "
         "batch scheduler latency throughput memory bytes blocks tenant salt router").split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="encoder checkpoint (default: bundled all-MiniLM-L6-v2)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads, both sides")
    parser.add_argument("--num-texts", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=32,
                        help="requests in flight in the one-text-a-request row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true",
                        help="smoke-test sizes; the figures mean nothing")
    parser.add_argument("--plot", default=None, help="write a PNG here")
    parser.add_argument("--json", default=None, help="write the figures as JSON here")


def make_texts(num_texts: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 120))) + "."
            for _ in range(num_texts)]


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from contracts.default_model import default_embedding_model_path
    from engine.embedding.embedder import Embedder

    if args.tiny:
        args.num_texts, args.concurrency, args.threads = 24, 4, 1
    torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else default_embedding_model_path()
    texts = make_texts(args.num_texts, args.seed)
    embedder = Embedder.load(path)
    try:
        baseline = _Baseline(path, embedder.config)
        ours_single, ours_vectors = _timed(lambda: _ours_concurrent(embedder, texts,
                                                                    args.concurrency))
        base_single, _ = _timed(lambda: baseline.encode(texts, batch_size=1))
        ours_batched, _ = _timed(lambda: _ours_batched(embedder, texts, 32))
        base_batched, base_vectors = _timed(lambda: baseline.encode(texts, batch_size=32))
        stats = embedder.stats()
    finally:
        embedder.shutdown()
    cosines = (ours_vectors * base_vectors).sum(1) / (
        np.linalg.norm(ours_vectors, axis=1) * np.linalg.norm(base_vectors, axis=1))
    rows = {
        f"1 text/request, {args.concurrency} in flight": (len(texts) / ours_single,
                                                          len(texts) / base_single),
        "32 texts/request": (len(texts) / ours_batched, len(texts) / base_batched),
    }
    _print(rows, args, path, float(np.max(1 - cosines)), stats)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": str(path), "threads": args.threads, "num_texts": len(texts),
            "max_one_minus_cosine": float(np.max(1 - cosines)),
            "rows": {name: {"ours_texts_per_s": o, "baseline_texts_per_s": b, "ratio": o / b}
                     for name, (o, b) in rows.items()}}, indent=2))
    if args.plot:
        from bench.plotting import BarPanel, write_bar_chart

        write_bar_chart(args.plot, "Embedding throughput, same CPU", [BarPanel(
            "texts/s (higher is better)", "texts/s", list(rows),
            {"ours": [o for o, _ in rows.values()],
             "transformers + pooling": [b for _, b in rows.values()]})], columns=1)
    return 0


class _Baseline:
    """transformers' BertModel + the sentence-transformers pooling, batched as ST's encode:
    texts sorted by length, padded batches, truncated at max_seq_length."""

    def __init__(self, path: Path, config: Any) -> None:
        import tempfile
        import zipfile

        from transformers import AutoTokenizer, BertModel

        self._tmp = None
        directory = path
        if path.is_file():  # the bundled zip: transformers reads directories
            self._tmp = tempfile.TemporaryDirectory(prefix="aigw-embed-bench-")
            with zipfile.ZipFile(path) as archive:
                archive.extractall(self._tmp.name)
            directory = Path(self._tmp.name)
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.model = BertModel.from_pretrained(directory).eval()
        self.config = config

    def encode(self, texts: list[str], batch_size: int) -> np.ndarray:
        import numpy as np
        import torch
        import torch.nn.functional as F

        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))  # ST: longest first
        out = np.empty((len(texts), self.config.dimensions), dtype=np.float32)
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                chosen = order[start:start + batch_size]
                enc = self.tokenizer([texts[i] for i in chosen], padding=True, truncation=True,
                                     max_length=self.config.max_seq_length, return_tensors="pt")
                hidden = self.model(**enc).last_hidden_state
                if self.config.pooling == "cls":
                    vectors = hidden[:, 0]
                else:
                    mask = enc["attention_mask"][:, :, None].to(hidden.dtype)
                    vectors = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                if self.config.normalize:
                    vectors = F.normalize(vectors, dim=-1)
                out[chosen] = vectors.numpy()
        return out


def _timed(work: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    result = work()
    return time.perf_counter() - started, result


def _truncated_ids(embedder: Any, texts: list[str]) -> list[list[int]]:
    limit = embedder.config.max_seq_length  # as ST: truncate (keeping [SEP] last)
    return [ids if len(ids) <= limit else [*ids[:limit - 1], ids[-1]]
            for ids in embedder.tokenize(texts)]


def _ours_concurrent(embedder: Any, texts: list[str], concurrency: int) -> np.ndarray:
    import numpy as np

    out = np.empty((len(texts), embedder.config.dimensions), dtype=np.float32)

    async def client(indices: list[int]) -> None:
        for i in indices:
            ids = await asyncio.to_thread(_truncated_ids, embedder, [texts[i]])
            out[i] = (await embedder.embed(ids))[0]

    async def main() -> None:
        await asyncio.gather(*(client(list(range(c, len(texts), concurrency)))
                               for c in range(concurrency)))
    asyncio.run(main())
    return out


def _ours_batched(embedder: Any, texts: list[str], batch_size: int) -> np.ndarray:
    import numpy as np

    async def main() -> list[np.ndarray]:
        parts = []
        for start in range(0, len(texts), batch_size):
            ids = _truncated_ids(embedder, texts[start:start + batch_size])
            parts.append(await embedder.embed(ids))
        return parts
    return np.concatenate(asyncio.run(main()))


def _print(rows: dict[str, tuple[float, float]], args: argparse.Namespace, path: Path,
           max_gap: float, stats: Any) -> None:
    from bench.plotting import fmt, format_table

    print(f"model {path.name}  threads {args.threads}  texts {args.num_texts}  "
          f"(a shared, busy machine: compare the ratios, not the absolute figures)")
    table = [[name, fmt(ours), fmt(base), f"{ours / base:.2f}x"]
             for name, (ours, base) in rows.items()]
    print(format_table(["row", "ours texts/s", "transformers texts/s", "ratio"], table))
    print(f"max 1 - cosine(ours, transformers) = {max_gap:.2e}; our passes "
          f"{stats.num_passes_total}, attention rows "
          f"{stats.num_padded_tokens_total / max(1, stats.num_prompt_tokens_total):.2f}x"
          " the real tokens (the linear layers run on the real tokens only: packed)")
