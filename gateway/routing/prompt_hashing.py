"""The gateway computes a request's KV block hashes exactly as the replica will.

    hasher = PromptHasher(load_tokenizer(model_path))
    hashes = hasher.block_hashes(upstream_body, model_id, block_size)

Exactness by construction: `upstream_body` is the JSON the replica backend sends (it carries the
request's `cache_salt`), and it is parsed and rendered by the replica's own code
(contracts/replica_protocol.py + prompts.py: same messages mapping, chat template, tools), then hashed
with contracts/block_hash.py, the shared contract.

Cost (SmolLM2 tokenizer, ~1,640-token agent prompt with 12 tools, one core): about 4.2 ms
uncached, of which 2.5 ms is BPE encoding. Encoding is therefore cached per *segment*: the
rendered text is cut after every special token (`<|im_end|>` ...); the tokenizer matches added
special tokens before the BPE model runs, so segments encode independently and an agent loop's
resent system+tools segment is a cache hit. See tests/routing/test_prompt_hashing.py for the
exactness check and the report for measured figures.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

from chat.tokenizer import Tokenizer
from contracts.block_hash import hash_blocks


class _SegmentCache:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.num_hits = 0
        self.num_misses = 0
        self._entries: OrderedDict[str, list[int]] = OrderedDict()

    def get(self, text: str) -> list[int] | None:
        ids = self._entries.get(text)
        if ids is None:
            self.num_misses += 1
            return None
        self.num_hits += 1
        self._entries.move_to_end(text)
        return ids

    def put(self, text: str, ids: list[int]) -> None:
        self._entries[text] = ids
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


class PromptHasher:
    """Thread-safe enough for one worker thread at a time (the segment cache is an OrderedDict
    guarded by the GIL; a lost update only costs a cache miss). CPU-bound: call off the loop."""

    def __init__(self, tokenizer: Tokenizer, max_cached_segments: int = 4096,
                 min_cached_segment_chars: int = 256) -> None:
        self.tokenizer = tokenizer
        self.min_cached_segment_chars = min_cached_segment_chars
        self.segments = _SegmentCache(max_cached_segments)
        specials = sorted({t for t in tokenizer.convert_ids_to_tokens(sorted(tokenizer.special_token_ids))
                           if t}, key=len, reverse=True)
        self._split = re.compile("|".join(map(re.escape, specials))) if specials else None

    def token_ids(self, upstream_body: dict[str, Any]) -> list[int]:
        """The prompt token ids the replica computes for this chat or completion body."""
        from contracts.replica_protocol import ChatCompletionRequest, CompletionRequest
        from engine.server.prompts import chat_template_messages, chat_template_tools

        if "messages" not in upstream_body:
            completion = CompletionRequest.model_validate(upstream_body)
            prompt = completion.prompt
            text = prompt if isinstance(prompt, str) else next(
                (p for p in prompt if isinstance(p, str)), None)
            if text is None:
                from engine.server.prompts import completion_prompts

                served: Any = self.tokenizer
                return completion_prompts(completion, served, self.tokenizer.vocab_size)[0]
            return self.tokenizer.encode(text, add_special_tokens=True)
        chat = ChatCompletionRequest.model_validate(upstream_body)
        text = self.tokenizer.apply_chat_template(
            chat_template_messages(chat), tools=chat_template_tools(chat),
            add_generation_prompt=True, continue_final_message=chat.continue_final_message)
        return self.encode_segmented(text)

    def encode_segmented(self, text: str) -> list[int]:
        """`tokenizer.encode(text)`, computed segment by segment with a cache."""
        if self._split is None:
            return self.tokenizer.encode(text)
        ids: list[int] = []
        start = 0
        for match in self._split.finditer(text):
            ids += self._encode_segment(text[start:match.end()])
            start = match.end()
        if start < len(text):
            ids += self._encode_segment(text[start:])
        return ids

    def _encode_segment(self, segment: str) -> list[int]:
        if len(segment) < self.min_cached_segment_chars:
            return self.tokenizer.encode(segment)
        ids = self.segments.get(segment)
        if ids is None:
            ids = self.tokenizer.encode(segment)
            self.segments.put(segment, ids)
        return ids

    def block_hashes(self, upstream_body: dict[str, Any], model_id: str, block_size: int) -> list[int]:
        """Hashes of every full block of the prompt, with the body's cache_salt (None if absent)."""
        salt = upstream_body.get("cache_salt")
        return hash_blocks(self.token_ids(upstream_body), block_size, model_id,
                           salt if isinstance(salt, str) else None)
