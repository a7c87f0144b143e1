"""POST /v1/embeddings through the gateway with the real openai SDK: real keys and metering
(SQLite), the bundled all-MiniLM-L6-v2 on an embedding replica over real sockets, and the same
replica behind the generic OpenAI-compatible backend."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from contracts.default_model import DEFAULT_EMBEDDING_MODEL_NAME as MODEL
from gateway.settings import GatewaySettings
from gateway.web.keys import METER
from gateway.web.services import create_served_app
from tests.gateway.conftest import LoopThread, start_app, wait_until

VIA_OPENAI_BACKEND = "minilm-via-openai-backend"
TEXTS = ["Routing sends a prompt to the replica holding its prefix.", "short", "Zürich im Regen"]


@pytest.fixture(scope="module")
def served(default_embedder: Any, loop_thread: LoopThread,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Any]]:
    from engine.server.embeddings import create_embedding_app
    from engine.server.settings import ReplicaServerSettings

    replica, replica_url = loop_thread.run(start_app(create_embedding_app(
        default_embedder, ReplicaServerSettings(secret="s3cret"))))
    data_dir = tmp_path_factory.mktemp("aigw")
    prices = {"input_per_token": 1e-6, "output_per_token": 5e-6}
    settings = GatewaySettings(data_dir=data_dir, replica_secret="s3cret", health_interval_s=0.2,
                               models=[
        {"name": MODEL, "backend": "replica", "endpoints": [replica_url], "prices": prices},
        {"name": VIA_OPENAI_BACKEND, "backend": "openai", "endpoints": [replica_url],
         "upstream_model": MODEL, "api_key": "s3cret", "send_cache_salt": False}])
    app = loop_thread.run(create_served_app(settings))
    runner, url = loop_thread.run(start_app(app))
    key = (data_dir / "default-key.txt").read_text().split()[-1]
    yield url, key, app[METER]
    loop_thread.run(runner.cleanup())
    loop_thread.run(replica.cleanup())


@pytest.fixture
def client(served: tuple[str, str, Any]) -> openai.OpenAI:
    url, key, _ = served
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def _direct(embedder: Any, texts: list[str]) -> np.ndarray:
    return asyncio.run(embedder.embed(embedder.tokenize(texts)))


def _records(loop_thread: LoopThread, meter: Any) -> list[Any]:
    return [r for r in loop_thread.run(meter.usage_records("default"))]


def test_sdk_vectors_equal_the_engine_in_base64_and_float(client: openai.OpenAI,
                                                          default_embedder: Any) -> None:
    expected = _direct(default_embedder, TEXTS)
    default = client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64
    as_float = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    for answer in (default, as_float):
        assert [d.index for d in answer.data] == [0, 1, 2]
        got = np.array([d.embedding for d in answer.data], dtype=np.float32)
        assert got.shape == (3, 384)
        assert np.allclose(got, expected, atol=1e-6)
        assert answer.model == MODEL
        assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(
            map(len, default_embedder.tokenize(TEXTS)))


def test_raw_base64_is_float32_little_endian(served: tuple[str, str, Any],
                                             default_embedder: Any) -> None:
    url, key, _ = served
    body = httpx.post(url + "/v1/embeddings", headers={"authorization": f"Bearer {key}"},
                      json={"model": MODEL, "input": "hello", "encoding_format": "base64"}).json()
    raw = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(raw, _direct(default_embedder, ["hello"])[0], atol=1e-7)


def test_dimensions_truncate_and_renormalize(client: openai.OpenAI, default_embedder: Any) -> None:
    full = _direct(default_embedder, ["a text to shorten"])[0]
    answer = client.embeddings.create(model=MODEL, input="a text to shorten", dimensions=64)
    short = np.array(answer.data[0].embedding)
    assert short.shape == (64,)
    assert np.linalg.norm(short) == pytest.approx(1.0, abs=1e-5)
    assert np.allclose(short, full[:64] / np.linalg.norm(full[:64]), atol=1e-6)


def test_token_id_inputs_equal_their_text(client: openai.OpenAI, default_embedder: Any) -> None:
    ids = default_embedder.tokenize(TEXTS[:2])
    single = client.embeddings.create(model=MODEL, input=ids[0])
    several = client.embeddings.create(model=MODEL, input=ids)
    expected = _direct(default_embedder, TEXTS[:2])
    assert np.allclose(single.data[0].embedding, expected[0], atol=1e-6)
    assert np.allclose([d.embedding for d in several.data], expected, atol=1e-6)
    assert several.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_each_request_is_metered_once_as_input_tokens(client: openai.OpenAI,
                                                      served: tuple[str, str, Any],
                                                      loop_thread: LoopThread) -> None:
    _, _, meter = served
    before = len(_records(loop_thread, meter))
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=["one", "two", "three"])
    answer = raw.parse()
    assert wait_until(lambda: len(_records(loop_thread, meter)) == before + 1)
    record = _records(loop_thread, meter)[-1]
    assert record.request_id == raw.headers["x-request-id"]
    assert (record.model, record.status, record.stream) == (MODEL, 200, False)
    assert record.prompt_tokens == answer.usage.prompt_tokens and record.completion_tokens == 0
    assert record.cost_usd == pytest.approx(answer.usage.prompt_tokens * 1e-6)
    assert not wait_until(lambda: len(_records(loop_thread, meter)) > before + 1, timeout_s=0.5)


def test_bad_input_is_an_openai_error_and_not_metered(client: openai.OpenAI,
                                                      served: tuple[str, str, Any],
                                                      loop_thread: LoopThread) -> None:
    _, _, meter = served
    before = len(_records(loop_thread, meter))
    for kwargs, param in [({"input": ""}, "input"), ({"input": []}, "input"),
                          ({"input": ["ok", 7]}, "input[1]"),
                          ({"input": "x", "dimensions": 0}, "dimensions"),
                          ({"input": "x", "encoding_format": "int8"}, "encoding_format")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.embeddings.create(model=MODEL, **kwargs)
        assert caught.value.status_code == 400
        assert caught.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")
    assert len(_records(loop_thread, meter)) == before  # refused at admission: no record


def test_upstream_refusals_pass_through_as_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=MODEL, input="x", dimensions=385)
    with pytest.raises(openai.BadRequestError, match="at most 256"):
        client.embeddings.create(model=MODEL, input="word " * 300)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.embeddings.create(model=MODEL, input=[[101, 10**6, 102]])


def test_a_key_is_required(served: tuple[str, str, Any]) -> None:
    url, _, _ = served
    bad = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.embeddings.create(model=MODEL, input="x")


def test_the_openai_compatible_backend_forwards_embeddings(client: openai.OpenAI,
                                                           default_embedder: Any) -> None:
    expected = _direct(default_embedder, TEXTS)
    for encoding_format in ("float", "base64"):
        answer = client.embeddings.create(model=VIA_OPENAI_BACKEND, input=TEXTS,
                                          encoding_format=encoding_format)  # type: ignore[arg-type]
        # (asked for explicitly, base64 comes back undecoded from the SDK)
        got = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4")
                        if isinstance(d.embedding, str) else d.embedding for d in answer.data],
                       dtype=np.float32)
        assert np.allclose(got, expected, atol=1e-6)
        assert answer.model == VIA_OPENAI_BACKEND


def test_the_embedding_model_is_listed(client: openai.OpenAI) -> None:
    assert MODEL in {m.id for m in client.models.list()}




def test_an_upstreams_embeddings_are_read_by_index_and_malformed_ones_refused() -> None:
    from array import array

    from gateway.backends.embeddings import read_embeddings
    from gateway.request.errors import UpstreamUnavailable

    one, two = array("f", [1.0, 2.0]).tobytes(), array("f", [3.0, 4.0]).tobytes()
    body = {"data": [{"index": 1, "embedding": base64.b64encode(two).decode()},
                     {"index": 0, "embedding": [1.0, 2.0]}]}
    assert read_embeddings(body, 2) == (one, two)
    for bad in [{"data": [{"index": 0, "embedding": [1.0]}]},  # one vector for two inputs
                {"data": [{"index": 0, "embedding": [1.0]}, {"index": 0, "embedding": [2.0]}]},
                {"data": [{"index": 0, "embedding": "not base64!"}, {"index": 1, "embedding": []}]},
                {"data": [{"index": 0, "embedding": [True]}, {"index": 1, "embedding": [1.0]}]},
                {"data": "x"}, []]:
        with pytest.raises(UpstreamUnavailable):
            read_embeddings(bad, 2)
