"""The embedder: an encoder, its tokenizer, and one worker thread that batches requests.

    embedder = Embedder.load(path, EmbedderConfig(), device="cpu", replica_id="r0")
    ids = embedder.tokenize(["a text", ...])            # any thread; [CLS] ... [SEP]
    vectors = await embedder.embed(ids)                  # float32 [N, C], pooled (+ normalized)
    embedder.shutdown()

Batching across requests: `embed` queues its inputs and awaits them. The worker takes a window of
the oldest queued inputs (at most 4 passes' worth, from any number of requests), sorts it by
length, and cuts it into passes of at most `max_num_inputs` inputs and `max_num_batched_tokens`
tokens. A pass is packed (engine/models/bert.py: the inputs end to end, no padding but in
attention), and its attention's padded rows (inputs x the longest input) stay within twice the
token budget; sorting keeps that padding small. A request is answered when its last input is
done. A caller that stops waiting (cancelled) has its inputs skipped if they are not yet in a
pass. More than the queue's bounds waiting: `EmbedderBusy` (a 503).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.embedding.config import EmbedderConfig, EncoderConfig
from engine.embedding.pooling import normalize, pool
from engine.models.bert import BertEncoder

log = logging.getLogger(__name__)
_WINDOW_PASSES = 4


class EmbedderBusy(RuntimeError):
    """Too many inputs are waiting already."""


class EmbedderDead(RuntimeError):
    """The worker thread failed; the embedder serves nothing more."""


@dataclass
class _Job:
    """One request's inputs and where their vectors go."""

    token_ids: list[np.ndarray]  # int32, one array per input
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[np.ndarray]
    vectors: np.ndarray
    num_left: int = 0

    def is_abandoned(self) -> bool:
        return self.future.done()  # cancelled by its caller (or failed)


@dataclass
class EmbedderStats:
    """What /metrics reports (the replica's gauge names; an embedder holds no KV blocks)."""

    num_running_requests: int = 0
    num_waiting_requests: int = 0
    num_kv_blocks_total: int = 0
    num_kv_blocks_used: int = 0
    num_prefix_cache_queried_tokens: int = 0
    num_prefix_cache_hit_tokens: int = 0
    num_prompt_tokens_total: int = 0
    num_generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    num_passes_total: int = 0
    num_padded_tokens_total: int = 0  # attention rows, padding included (>= prompt tokens)


@dataclass
class _Item:
    job: _Job
    index: int  # in job.token_ids

    @property
    def num_tokens(self) -> int:
        return int(self.job.token_ids[self.index].shape[0])


@dataclass
class _Queue:
    items: deque[_Item] = field(default_factory=deque)
    num_tokens: int = 0  # in `items`


class Embedder:
    def __init__(self, config: EncoderConfig, model: BertEncoder, tokenizer: object,
                 batching: EmbedderConfig, replica_id: str = "replica-0") -> None:
        self.config, self.model, self.batching = config, model, batching
        self.replica_id = replica_id
        self._tokenizer = tokenizer
        self._stats = EmbedderStats()
        self._queue = _Queue()
        self._cond = threading.Condition()
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="aigw-embedder", daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, path: str | Path, batching: EmbedderConfig | None = None, device: str = "cpu",
             dtype: torch.dtype = torch.float32, replica_id: str = "replica-0") -> Embedder:
        from tokenizers import Tokenizer

        from engine.loader.hf_bert import load_encoder_checkpoint

        checkpoint = load_encoder_checkpoint(path)
        model = BertEncoder(checkpoint.config, dict(checkpoint.weights), torch.device(device),
                            dtype)
        tokenizer = Tokenizer.from_str(checkpoint.tokenizer_json)
        tokenizer.no_truncation()
        tokenizer.no_padding()
        return cls(checkpoint.config, model, tokenizer, batching or EmbedderConfig(), replica_id)

    # ---- any thread ----------------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return self.config.model_id

    @property
    def is_alive(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids with the model's special tokens ([CLS] ... [SEP]), untruncated."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=True)  # type: ignore[attr-defined]
        return [encoding.ids for encoding in encodings]

    def stats(self) -> EmbedderStats:
        with self._cond:
            return EmbedderStats(**vars(self._stats))

    async def embed(self, token_ids: list[list[int]]) -> np.ndarray:
        """float32 [len(token_ids), dimensions]; each list non-empty, within max_seq_length and
        the vocabulary (the caller checks). Raises EmbedderBusy, EmbedderDead."""
        loop = asyncio.get_running_loop()
        num_tokens = sum(map(len, token_ids))
        batching = self.batching
        if (len(token_ids) > batching.max_num_queued_inputs
                or num_tokens > batching.max_num_queued_tokens):
            raise EmbedderBusy(f"{len(token_ids)} inputs of {num_tokens} tokens are more than "
                               "the embedder queues")
        job = _Job([np.asarray(ids, dtype=np.int32) for ids in token_ids], loop,
                   loop.create_future(),
                   np.empty((len(token_ids), self.config.dimensions), dtype=np.float32),
                   num_left=len(token_ids))
        if not token_ids:
            return job.vectors
        with self._cond:
            if self._error is not None or self._stopped:
                raise EmbedderDead(f"the embedder is not running: {self._error}")
            if (len(self._queue.items) + len(token_ids) > batching.max_num_queued_inputs
                    or self._queue.num_tokens + num_tokens > batching.max_num_queued_tokens):
                raise EmbedderBusy(f"{len(self._queue.items)} inputs of "
                                   f"{self._queue.num_tokens} tokens are waiting already")
            self._queue.items.extend(_Item(job, i) for i in range(len(token_ids)))
            self._queue.num_tokens += num_tokens
            self._stats.num_waiting_requests += 1
            self._cond.notify()
        return await job.future

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # ---- the worker thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                window = self._take_window()
                if window is None:
                    return
                for batch in self._passes(window):
                    self._run_pass(batch)
                with self._cond:
                    self._stats.num_running_requests = 0
        except BaseException as exc:  # noqa: BLE001 - every failure reaches the waiting callers
            log.exception("embedder loop failed")
            with self._cond:
                self._error = exc
                pending = list(self._queue.items)
                self._queue.items.clear()
                self._queue.num_tokens = 0
            for job in {id(item.job): item.job for item in pending}.values():
                _fail(job, EmbedderDead(f"embedder failed: {exc}"))

    def _take_window(self) -> list[_Item] | None:
        """The oldest queued inputs, at most `_WINDOW_PASSES` passes' worth (None: stop)."""
        limit = self.batching.max_num_inputs * _WINDOW_PASSES
        with self._cond:
            while not self._queue.items and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return None
            window = []
            while self._queue.items and len(window) < limit:
                item = self._queue.items.popleft()
                self._queue.num_tokens -= item.num_tokens
                if not item.job.is_abandoned():
                    window.append(item)
            self._stats.num_waiting_requests = len({id(i.job) for i in self._queue.items})
            self._stats.num_running_requests = len({id(i.job) for i in window})
            return window

    def _passes(self, window: list[_Item]) -> list[list[_Item]]:
        """`window` sorted by length and cut into passes within the batch bounds."""
        window.sort(key=lambda item: item.num_tokens)
        budget = self.batching.max_num_batched_tokens
        passes: list[list[_Item]] = []
        current: list[_Item] = []
        num_tokens = 0
        for item in window:  # ascending: the new item is the longest of its pass
            padded = (len(current) + 1) * item.num_tokens
            if current and (len(current) >= self.batching.max_num_inputs
                            or num_tokens + item.num_tokens > budget or padded > 2 * budget):
                passes.append(current)
                current, num_tokens = [], 0
            current.append(item)
            num_tokens += item.num_tokens
        if current:
            passes.append(current)
        return passes

    def _run_pass(self, batch: list[_Item]) -> None:
        batch = [item for item in batch if not item.job.is_abandoned()]
        if not batch:
            return
        device = self.model.device
        lengths_list = [item.num_tokens for item in batch]
        t = max(lengths_list)
        packed = np.concatenate([item.job.token_ids[item.index] for item in batch])
        ids = torch.from_numpy(packed.astype(np.int64))
        lengths = torch.tensor(lengths_list, device=device)
        hidden = self.model.forward(ids.to(device), lengths)  # [N, C], N = sum(lengths)
        vectors = pool(hidden.float(), lengths, self.config.pooling)  # (float32 sums)
        if self.config.normalize:
            vectors = normalize(vectors)
        rows = vectors.cpu().numpy()
        with self._cond:
            self._stats.num_passes_total += 1
            self._stats.num_prompt_tokens_total += sum(lengths_list)
            self._stats.num_padded_tokens_total += len(batch) * t
        for row, item in enumerate(batch):
            job = item.job
            job.vectors[item.index] = rows[row]
            job.num_left -= 1
            if job.num_left == 0:
                job.loop.call_soon_threadsafe(_resolve, job)


def _resolve(job: _Job) -> None:
    if not job.future.done():
        job.future.set_result(job.vectors)


def _fail(job: _Job, exc: BaseException) -> None:
    def fail() -> None:
        if not job.future.done():
            job.future.set_exception(exc)
    job.loop.call_soon_threadsafe(fail)
