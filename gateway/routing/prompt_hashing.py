"""The gateway computes a request's KV block hashes exactly as the replica will.

    hasher = PromptHasher(load_tokenizer(model_path))
    hashes = hasher.block_hashes(upstream_body, model_id, block_size)

Exactness by construction: `upstream_body` is the JSON the replica backend sends (it carries the
request's `cache_salt`), and it is parsed and rendered by the replica's own code
(contracts/replica_protocol.py + chat/render.py: same messages mapping, chat format, template,
tools), then hashed with contracts/block_hash.py, the shared contract. The ids are sent on to the
replica with the renderer's `render_id` (gateway/backends/replica.py), which then renders nothing.

Cost (SmolLM2 tokenizer, ~1,640-token agent prompt with 12 tools, one core): about 4.2 ms
uncached, of which 2.5 ms is BPE encoding. Encoding is therefore cached per *segment*: the
rendered text is cut after every special token (`<|im_end|>` ...); the tokenizer matches added
special tokens before the BPE model runs, so segments encode independently and an agent loop's
resent system+tools segment is a cache hit (for the same tenant: the cache is keyed by the
body's `cache_salt` and bounded in bytes, see `PromptHasher`). See
tests/gateway/routing/test_prompt_hashing.py for the exactness check and the report for measured
figures.
"""

from __future__ import annotations

import array
import functools
import re
import sys
from collections.abc import Sequence
from typing import Any

from chat.tokenizer import Tokenizer
from contracts.block_hash import hash_blocks
from infra.byte_lru import ByteLRU, str_bytes

DEFAULT_SEGMENT_CACHE_MAX_BYTES = 32 * 1024 * 1024
_MAX_SEGMENT_BYTES_FRACTION = 8  # one segment takes at most 1/8 of the cache


@functools.lru_cache(maxsize=8)
def shared_prompt_hasher(path: str, segment_cache_max_bytes: int) -> PromptHasher:
    """The one hasher (and so the one segment cache) of a tokenizer, shared by the prefix router
    and the replica backend's token counts; its chat format is the checkpoint's, chosen as the
    replica chooses it (its architecture and template)."""
    from chat.render import checkpoint_architecture
    from chat.tokenizer import load_tokenizer

    return PromptHasher(load_tokenizer(path), segment_cache_max_bytes=segment_cache_max_bytes,
                        architecture=checkpoint_architecture(path))


class PromptHasher:
    """Thread-safe enough for one worker thread at a time (the segment cache is an OrderedDict
    guarded by the GIL; a lost update only costs a cache miss). CPU-bound: call off the loop.

    The segment cache is bounded in bytes (segment text + its ids, packed 4 bytes a token,
    `segment_cache_max_bytes`; one segment at most an eighth of it) and keyed by (cache_salt,
    segment): what one tenant's requests warm is never a hit, nor a timing difference, for
    another's."""

    def __init__(self, tokenizer: Tokenizer,
                 segment_cache_max_bytes: int = DEFAULT_SEGMENT_CACHE_MAX_BYTES,
                 min_cached_segment_chars: int = 256, architecture: str = "") -> None:
        from chat.registry import chat_format_for
        from chat.render import PromptRenderer

        self.tokenizer = tokenizer
        template = getattr(tokenizer.chat_template, "source", None)
        self.renderer = PromptRenderer(tokenizer, chat_format_for(architecture, template,
                                                                  tokenizer.token_to_id))
        self.min_cached_segment_chars = min_cached_segment_chars
        self.segments: ByteLRU[tuple[str | None, str], array.array[int]] = ByteLRU(
            segment_cache_max_bytes, segment_cache_max_bytes // _MAX_SEGMENT_BYTES_FRACTION)
        specials = sorted({t
                           for t in tokenizer.convert_ids_to_tokens(
                               sorted(tokenizer.special_token_ids))
                           if t}, key=len, reverse=True)
        self._split = re.compile("|".join(map(re.escape, specials))) if specials else None

    def token_ids(self, upstream_body: dict[str, Any], max_model_len: int | None = None
                  ) -> list[int]:
        """The prompt token ids the replica computes for this chat or completion body. Given
        `max_model_len`, a prompt whose length alone proves it cannot fit is refused before it
        is encoded, as the replica refuses it (contracts.replica_errors.ContextLengthExceeded)."""
        from contracts.replica_prompts import refuse_surely_too_long
        from contracts.replica_protocol import ChatCompletionRequest, CompletionRequest

        if "messages" not in upstream_body:
            completion = CompletionRequest.model_validate(upstream_body)
            prompt = completion.prompt
            text = prompt if isinstance(prompt, str) else next(
                (p for p in prompt if isinstance(p, str)), None)
            served: Any = self.tokenizer
            if text is None:
                from contracts.replica_prompts import completion_prompts

                return completion_prompts(completion, served, self.tokenizer.vocab_size)[0]
            refuse_surely_too_long(text, served, None, max_model_len, "prompt")
            return self.tokenizer.encode(text, add_special_tokens=True)
        chat = ChatCompletionRequest.model_validate(upstream_body)
        salt = upstream_body.get("cache_salt")
        return self.renderer.render(chat, max_model_len=max_model_len, encode=lambda text: (
            self.encode_segmented(text, salt if isinstance(salt, str) else None))).token_ids

    def encode_segmented(self, text: str, salt: str | None = None) -> list[int]:
        """`tokenizer.encode(text)`, computed segment by segment with a cache of `salt`'s own."""
        if self._split is None:
            return self.tokenizer.encode(text)
        ids: list[int] = []
        start = 0
        for match in self._split.finditer(text):
            ids += self._encode_segment(text[start:match.end()], salt)
            start = match.end()
        if start < len(text):
            ids += self._encode_segment(text[start:], salt)
        return ids

    def _encode_segment(self, segment: str, salt: str | None) -> Sequence[int]:
        if len(segment) < self.min_cached_segment_chars:
            return self.tokenizer.encode(segment)
        key = (salt, segment)
        cached = self.segments.get(key)
        if cached is not None:
            return cached
        ids = self.tokenizer.encode(segment)
        packed = array.array("i", ids)  # 4 bytes a token, where a list of ints holds 36
        self.segments.put(key, packed, str_bytes(segment) + sys.getsizeof(packed)
                          + (str_bytes(salt) if salt else 0))
        return ids

    def block_hashes(self, upstream_body: dict[str, Any], model_id: str,
                     block_size: int) -> list[int]:
        """Hashes of every full block of the prompt, with the body's cache_salt (None if absent)."""
        salt = upstream_body.get("cache_salt")
        return hash_blocks(self.token_ids(upstream_body), block_size, model_id,
                           salt if isinstance(salt, str) else None)
