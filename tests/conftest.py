"""Shared fixtures for the whole suite. Keep this generic: subfolders add their own conftest.py."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.redis_server import flush_all, running_redis_server

# Triton kernels run in the interpreter on machines without a GPU (set before anything imports triton).
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
