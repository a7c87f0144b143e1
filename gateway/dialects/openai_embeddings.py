"""OpenAI Embeddings: POST /v1/embeddings.

    input            a string, an array of strings, an array of token ids, or an array of
                     token-id arrays (contracts/embeddings.py: at most 2,048, none empty)
    dimensions       forwarded (the replica shortens and renormalizes; more than the model's: 400)
    encoding_format  "float" (default) | "base64": the answer's form, whatever the upstream sent
    user             forwarded

Never streamed; the answer is `{"object": "list", "data": [{"object": "embedding", "index",
"embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}`. It reserves no output
tokens at admission (`max_tokens` 0) and is metered as prompt tokens only.
"""

from __future__ import annotations

from typing import Any

from contracts.embeddings import (
    EmbeddingInputError,
    parse_dimensions,
    parse_encoding_format,
    parse_inputs,
    vector_to_wire,
)
from gateway.dialects import openai_common as common
from gateway.dialects.base import Dialect, StreamEncoder
from gateway.dialects.validate import InvalidParam, get_str, need_object
from gateway.request.canonical import CanonicalRequest, CanonicalResponse


class OpenAIEmbeddings(Dialect):
    name = "openai"

    def parse(self, body: Any, request_id: str) -> CanonicalRequest:
        body = need_object(body, "body")
        model = get_str(body, "model", required=True, allow_empty=False) or ""
        request = CanonicalRequest(request_id, model, kind="embedding", max_tokens=0)
        if "input" not in body:
            raise InvalidParam("input", "is required")
        try:
            first, *request.extra_prompts = parse_inputs(body["input"])
            request.encoding_format = parse_encoding_format(body.get("encoding_format"))
            request.embedding_dimensions = parse_dimensions(body.get("dimensions"))
        except EmbeddingInputError as exc:
            raise InvalidParam(exc.param, str(exc).removeprefix(f"{exc.param} ")) from None
        if isinstance(first, str):
            request.prompt = first
        else:
            request.prompt_token_ids = first
        request.user = get_str(body, "user")
        return request

    def render(self, request: CanonicalRequest, response: CanonicalResponse) -> dict[str, Any]:
        vectors = response.embeddings or ()
        num_tokens = response.usage.prompt_tokens if response.usage is not None else 0
        return {"object": "list", "model": request.model,
                "data": [{"object": "embedding", "index": index,
                          "embedding": vector_to_wire(vector, request.encoding_format)}
                         for index, vector in enumerate(vectors)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    def encoder(self, request: CanonicalRequest) -> StreamEncoder:
        raise NotImplementedError("embeddings are never streamed")

    def error_body(self, status: int, code: str, message: str, param: str | None = None,
                   error_type: str | None = None) -> dict[str, Any]:
        return common.error_body(status, code, message, param, error_type)
