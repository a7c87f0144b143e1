"""The labels a request's usage record carries: its tags and its session, bounded in bytes.

    tags = usage_tags(body, request.headers)        # BadRequest (400) past the bounds
    session = usage_session(canonical)              # prompt_cache_key, else x-session-id

Tags come from the `x-aigw-tags` header (comma-separated) and from the body's `metadata` (an
object of string values, as OpenAI's; each pair becomes the tag "key:value"; Anthropic's
metadata.user_id so becomes "user_id:<id>"). Order is kept, repeats dropped. At most `MAX_TAGS`
tags of at most `MAX_TAG_BYTES` UTF-8 bytes each, no control characters; past that the request
is refused with 400 `invalid_tags` before anything is metered, so a record holds at most
4 KiB of tags. The session is the request's `prompt_cache_key`, else its `x-session-id` header, at
most `MAX_SESSION_BYTES` (400 `invalid_session` past it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.request.canonical import CanonicalRequest
from gateway.request.errors import BadRequest

TAGS_HEADER = "x-aigw-tags"
MAX_TAGS = 16
MAX_TAG_BYTES = 256
MAX_SESSION_BYTES = 256


def _check_tag(tag: str, where: str) -> str:
    if len(tag.encode("utf-8", "surrogatepass")) > MAX_TAG_BYTES:
        raise BadRequest(f"a usage tag ({where}) is over {MAX_TAG_BYTES} bytes",
                         code="invalid_tags", param=where)
    if any(ord(c) < 32 or ord(c) == 127 for c in tag):
        raise BadRequest(f"a usage tag ({where}) holds a control character",
                         code="invalid_tags", param=where)
    return tag


def usage_tags(body: Any, headers: Mapping[str, str]) -> tuple[str, ...]:
    """The request's tags (see the module docstring); () when it has none."""
    found: list[str] = []
    header = headers.get(TAGS_HEADER)
    if header:
        found += [_check_tag(t.strip(), TAGS_HEADER) for t in header.split(",") if t.strip()]
    metadata = body.get("metadata") if isinstance(body, dict) else None
    if isinstance(metadata, dict):
        if len(metadata) > MAX_TAGS:
            raise BadRequest(f"metadata has over {MAX_TAGS} pairs", code="invalid_tags",
                             param="metadata")
        for key, value in metadata.items():
            if not isinstance(value, str):
                raise BadRequest(f"metadata.{key[:64]} must be a string", code="invalid_tags",
                                 param="metadata")
            found.append(_check_tag(f"{key}:{value}", f"metadata.{key[:64]}"))
    elif metadata is not None:
        raise BadRequest("metadata must be an object of strings", code="invalid_tags",
                         param="metadata")
    tags = tuple(dict.fromkeys(found))
    if len(tags) > MAX_TAGS:
        raise BadRequest(f"a request has at most {MAX_TAGS} usage tags ({len(tags)} given, "
                         f"{TAGS_HEADER} and metadata together)", code="invalid_tags")
    return tags


def usage_session(request: CanonicalRequest) -> str | None:
    """The session usage is grouped by: prompt_cache_key, else the x-session-id header."""
    session = request.prompt_cache_key or request.session_id
    if session is None:
        return None
    where = "prompt_cache_key" if request.prompt_cache_key else "x-session-id"
    try:  # a header's bytes that are not UTF-8 arrive as surrogates: no store can keep them
        num_bytes = len(session.encode("utf-8"))
    except UnicodeEncodeError:
        raise BadRequest(f"{where} is not UTF-8 text", code="invalid_session",
                         param=where) from None
    if num_bytes > MAX_SESSION_BYTES:
        raise BadRequest(f"{where} is over {MAX_SESSION_BYTES} bytes", code="invalid_session",
                         param=where)
    return session
