"""Auth fixtures: the same tests run on the Redis store and on the embedded SQLite store."""

from __future__ import annotations

from pathlib import Path

import pytest

from auth.settings import AuthSettings
from tests.redis_cluster import clean_url_for


@pytest.fixture(params=["redis", "redis-cluster", "sqlite"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def auth_settings(store_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> AuthSettings:
    """Settings for one fresh store of `store_kind` (a flushed Redis or Redis Cluster, or a new
    data dir)."""
    redis_url = clean_url_for(store_kind, request)
    return AuthSettings(redis_url=redis_url, data_dir=tmp_path / "data",
                        revocation_poll_interval_s=0.1)
