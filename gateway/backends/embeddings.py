"""The embeddings call to an OpenAI-compatible upstream (`POST /v1/embeddings`): the body it
is sent and how its answer is read. OpenAICompatBackend (and so ReplicaBackend) streams an
embedding request as EmbeddingVectors, Finish, Usage (gateway/backends/openai_compat.py)."""

from __future__ import annotations

from typing import Any

from contracts.embeddings import vector_from_wire
from gateway.fleet.endpoints import Endpoint
from gateway.request.canonical import CanonicalRequest
from gateway.request.errors import UpstreamUnavailable


def embedding_body(request: CanonicalRequest, endpoint: Endpoint, encoding: str | None
                   ) -> dict[str, Any]:
    """The upstream's body; `encoding`: the encoding_format to ask for (None: the client's)."""
    first = request.prompt if request.prompt_token_ids is None else request.prompt_token_ids
    body: dict[str, Any] = {
        "model": endpoint.model.upstream_name,
        "input": [first, *request.extra_prompts] if request.extra_prompts else first,
        "encoding_format": encoding or request.encoding_format}
    if request.embedding_dimensions is not None:
        body["dimensions"] = request.embedding_dimensions
    if request.user is not None:
        body["user"] = request.user
    return body


def read_embeddings(body: Any, num_inputs: int) -> tuple[bytes, ...]:
    """An upstream's embeddings list, in input order (by `index`); UpstreamUnavailable when it
    is malformed or does not hold exactly one vector per input."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or len(data) != num_inputs:
        raise UpstreamUnavailable("upstream sent an embeddings list that does not match the input")
    vectors: list[bytes | None] = [None] * num_inputs
    for position, item in enumerate(data):
        index = item.get("index", position) if isinstance(item, dict) else None
        if type(index) is not int or not 0 <= index < num_inputs or vectors[index] is not None:
            raise UpstreamUnavailable("upstream sent an embedding of no input")
        try:
            vectors[index] = vector_from_wire(item.get("embedding"))
        except ValueError as exc:
            raise UpstreamUnavailable(f"upstream sent a malformed embedding: {exc}") from None
    return tuple(v for v in vectors if v is not None)
