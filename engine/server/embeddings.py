"""The embedding replica: an encoder served on its own HTTP app (no generation engine, no KV).

    app = create_embedding_app(embedder, settings)
    run_embedding_replica(embedder, host, port, settings)     # `aigw replica --model <encoder>`

Routes: POST /v1/embeddings (OpenAI's wire: contracts/embeddings.py), GET /v1/models, GET /health,
GET /metrics (the replica's gauge names; no KV blocks), and GET /kv/snapshot and /kv/events,
which report an empty cache (an encoder caches nothing), so the gateway's prefix router treats it
as any replica. The middlewares are the chat replica's (engine/server/app.py create_base_app):
error envelope, credential, body timeout.

A request: parse -> model -> inputs (texts tokenized in a worker thread; token ids taken as the
model's whole input, special tokens included, as vLLM does) -> each within max_seq_length and
the vocabulary (else 400) -> `embed` (batched with other requests' inputs) -> `dimensions` ->
vectors in `encoding_format`, usage {prompt_tokens, total_tokens}.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np
import orjson
from aiohttp import web

from contracts.embeddings import (
    EmbeddingInput,
    EmbeddingInputError,
    parse_dimensions,
    parse_encoding_format,
    parse_inputs,
    vector_to_wire,
)
from contracts.replica_errors import (
    ContextLengthExceeded,
    InvalidRequestError,
    NotFoundError,
    ServiceUnavailableError,
    json_response,
)
from engine.embedding.embedder import Embedder, EmbedderBusy, EmbedderDead
from engine.embedding.pooling import shorten
from engine.server.app import create_base_app, run_until_signal
from engine.server.metrics import CONTENT_TYPE, ReplicaMetrics
from engine.server.responses import model_list
from engine.server.settings import ReplicaServerSettings


@dataclass
class EmbeddingContext:
    embedder: Embedder
    settings: ReplicaServerSettings
    metrics: ReplicaMetrics
    started_at_s: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.embedder.model_id, *self.settings.served_model_aliases)


EMBEDDING_KEY = web.AppKey("embedding", EmbeddingContext)


def create_embedding_app(embedder: Embedder, settings: ReplicaServerSettings | None = None
                         ) -> web.Application:
    settings = settings or ReplicaServerSettings.from_env()
    app = create_base_app(settings)
    metrics = ReplicaMetrics(embedder.stats, model=embedder.model_id, replica=embedder.replica_id)
    app[EMBEDDING_KEY] = EmbeddingContext(embedder, settings, metrics)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_route)
    app.router.add_get("/kv/snapshot", kv_snapshot)
    app.router.add_get("/kv/events", kv_events)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        app.router.add_post(path, not_generative)
    return app


async def embeddings(request: web.Request) -> web.Response:
    ctx = request.app[EMBEDDING_KEY]
    embedder, config = ctx.embedder, ctx.embedder.config
    body = await _json_object(request)
    model = body.get("model")
    if model not in ctx.model_names:
        raise NotFoundError(f"The model `{model}` does not exist.", param="model",
                            code="model_not_found")
    try:
        inputs = parse_inputs(body.get("input"))
        encoding_format = parse_encoding_format(body.get("encoding_format"))
        num_dimensions = parse_dimensions(body.get("dimensions"))
    except EmbeddingInputError as exc:
        raise InvalidRequestError(str(exc), param=exc.param) from None
    if num_dimensions is not None and num_dimensions > config.dimensions:
        raise InvalidRequestError(f"dimensions {num_dimensions} is over this model's "
                                  f"{config.dimensions}", param="dimensions")
    token_ids = await asyncio.to_thread(_token_ids, embedder, inputs)
    try:
        vectors = await embedder.embed(token_ids)
    except EmbedderBusy as exc:
        raise ServiceUnavailableError(f"The embedder is busy: {exc}") from None
    except EmbedderDead as exc:
        raise ServiceUnavailableError(str(exc)) from None
    if num_dimensions is not None and num_dimensions < config.dimensions:
        vectors = shorten(vectors, num_dimensions, renormalize=config.normalize)
    num_tokens = sum(map(len, token_ids))
    data = [{"object": "embedding", "index": i,
             "embedding": vector_to_wire(_le_bytes(row), encoding_format)}
            for i, row in enumerate(vectors)]
    return json_response({"object": "list", "data": data, "model": model,
                          "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


def _token_ids(embedder: Embedder, inputs: list[EmbeddingInput]) -> list[list[int]]:
    """Every input's ids (texts tokenized in one batch), each checked against the model."""
    config = embedder.config
    texts = [(i, item) for i, item in enumerate(inputs) if isinstance(item, str)]
    ids: list[list[int]] = [item if isinstance(item, list) else [] for item in inputs]
    for (i, _), encoded in zip(texts, embedder.tokenize([t for _, t in texts]), strict=True):
        ids[i] = encoded
    for i, row in enumerate(ids):
        param = "input" if len(ids) == 1 else f"input[{i}]"
        if not row:  # (a tokenizer without special tokens, on a text of whitespace)
            raise InvalidRequestError(f"{param} has no tokens", param=param)
        if len(row) > config.max_seq_length:
            raise ContextLengthExceeded(
                f"{param} has {len(row)} tokens; this model embeds at most "
                f"{config.max_seq_length}", param=param)
        if max(row) >= config.vocab_size:
            raise InvalidRequestError(f"{param}: token id {max(row)} is out of the vocabulary "
                                      f"(0..{config.vocab_size - 1})", param=param)
    return ids


def _le_bytes(row: np.ndarray) -> bytes:
    return row.astype("<f4", copy=False).tobytes()


async def _json_object(request: web.Request) -> dict[str, object]:
    raw = await request.read()  # HTTPRequestEntityTooLarge over client_max_size
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    return payload


async def not_generative(request: web.Request) -> web.Response:
    model = request.app[EMBEDDING_KEY].embedder.model_id
    raise InvalidRequestError(f"`{model}` is an embedding model: it serves POST /v1/embeddings "
                              "only", param="model", code="model_not_generative")


async def models(request: web.Request) -> web.Response:
    ctx = request.app[EMBEDDING_KEY]
    config = ctx.embedder.config
    listing = model_list(ctx.model_names, config.model_id, ctx.started_at_s,
                         config.max_seq_length)
    for entry in listing["data"]:
        entry["embedding_dimensions"] = config.dimensions
    return json_response(listing)


async def health(request: web.Request) -> web.Response:
    if not request.app[EMBEDDING_KEY].embedder.is_alive:
        raise ServiceUnavailableError("The embedder thread is not running.")
    return json_response({"status": "ok"})


async def metrics_route(request: web.Request) -> web.Response:
    body = request.app[EMBEDDING_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def kv_snapshot(request: web.Request) -> web.Response:
    replica_id = request.app[EMBEDDING_KEY].embedder.replica_id
    return json_response({"replica_id": replica_id, "seq": 0, "block_size": 1,
                          "block_hashes": []})


async def kv_events(request: web.Request) -> web.Response:
    replica_id = request.app[EMBEDDING_KEY].embedder.replica_id
    return json_response({"replica_id": replica_id, "first_seq": 0, "last_seq": 0,
                          "snapshot_required": False, "batches": []})


def run_embedding_replica(embedder: Embedder, host: str, port: int,
                          settings: ReplicaServerSettings) -> None:
    """Serve until SIGINT/SIGTERM (then in-flight requests get up to 60 s)."""
    run_until_signal(lambda: create_embedding_app(embedder, settings), host, port, settings)
