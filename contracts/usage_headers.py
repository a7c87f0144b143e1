"""The prompt usage a replica announces in a stream's response headers: a contract between the
replica server (engine/server/choices.py) and the gateway; torch-free, so the gateway imports it.

A stream's headers go out once every engine request has produced its first token
(engine/server/fanout.py), so the prompt's token count and its prefix-cache hit are already
exact there, long before the usage chunk at the stream's end. The gateway reads them
(gateway/backends/openai_compat.py) to fill Anthropic's `message_start` usage, and to bill the
prompt exactly when a stream is cut before its usage chunk. Plain OpenAI clients ignore them.
"""

from __future__ import annotations

PROMPT_TOKENS_HEADER = "x-aigw-prompt-tokens"  # every prompt's tokens, each prompt counted once
CACHED_TOKENS_HEADER = "x-aigw-cached-tokens"  # of those, served from the prefix cache
