"""Embeddings lines in a batch: the bundled all-MiniLM-L6-v2 on an embedding replica, the openai
SDK's batch flow through the gateway with real keys and SQLite metering; the vectors equal the
engine's own, and each line is metered once at the batch price."""

from __future__ import annotations

import asyncio
import base64
import io
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from contracts.default_model import DEFAULT_EMBEDDING_MODEL_NAME as MODEL
from gateway.settings import GatewaySettings
from gateway.web.services import create_served_app
from tests.gateway.batch.test_batch_api import jsonl, read_jsonl, wait_done
from tests.gateway.conftest import LoopThread, start_app

TEXTS = ["A batch runs on idle capacity.", "short", "Zürich im Regen", "A batch runs at night."]
PRICE = 1e-6


@pytest.fixture(scope="module")
def served(default_embedder: Any, loop_thread: LoopThread,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    from engine.server.embeddings import create_embedding_app
    from engine.server.settings import ReplicaServerSettings

    replica, replica_url = loop_thread.run(start_app(create_embedding_app(
        default_embedder, ReplicaServerSettings(secret="s3cret"))))
    data_dir = tmp_path_factory.mktemp("batch-embeddings")
    settings = GatewaySettings(
        data_dir=data_dir, replica_secret="s3cret", health_interval_s=0.2,
        batch={"poll_interval_s": 0.1},
        models=[{"name": MODEL, "backend": "replica", "endpoints": [replica_url],
                 "prices": {"input_per_token": PRICE}}])
    runner, url = loop_thread.run(start_app(loop_thread.run(create_served_app(settings))))
    key = (data_dir / "default-key.txt").read_text().split()[-1]
    yield url, key, data_dir
    loop_thread.run(runner.cleanup())
    loop_thread.run(replica.cleanup())


def test_embedding_lines_equal_the_engines_vectors_and_are_metered_once(
        served: tuple[str, str, Path], default_embedder: Any) -> None:
    url, key, data_dir = served
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
    lines = [{"custom_id": "one", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": MODEL, "input": TEXTS[0]}},
             {"custom_id": "many", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": MODEL, "input": TEXTS[1:], "encoding_format": "base64"}},
             {"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": MODEL, "input": []}}]
    uploaded = client.files.create(file=("e.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                  completion_window="24h")
    done = wait_done(client, batch.id)
    assert done.status == "completed" and (done.request_counts.completed,
                                           done.request_counts.failed) == (2, 1)
    outputs = {o["custom_id"]: o["response"]["body"]
               for o in read_jsonl(client, done.output_file_id)}
    expected = asyncio.run(default_embedder.embed(default_embedder.tokenize(TEXTS)))
    assert np.allclose(outputs["one"]["data"][0]["embedding"], expected[0], atol=1e-6)
    many = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
            for d in outputs["many"]["data"]]
    assert np.allclose(np.stack(many), expected[1:], atol=1e-6)
    (error,) = read_jsonl(client, done.error_file_id)
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    with sqlite3.connect(data_dir / "aigw.sqlite3") as conn:
        rows = conn.execute("SELECT request_id, prompt_tokens, cost_nanos FROM usage WHERE "
                            "request_id LIKE ? ORDER BY request_id", (batch.id + "/%",)).fetchall()
    assert [r[0] for r in rows] == [f"{batch.id}/0", f"{batch.id}/1"]
    num_tokens = [len(t) for t in default_embedder.tokenize(TEXTS)]
    assert [r[1] for r in rows] == [num_tokens[0], sum(num_tokens[1:])]
    assert all(r[2] == round(r[1] * PRICE * 0.5 * 1e9) for r in rows)  # the default discount
