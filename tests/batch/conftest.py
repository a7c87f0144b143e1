"""The Batch API tests share the gateway tests' event-loop thread."""

from tests.gateway.conftest import loop_thread  # noqa: F401 - a fixture, used by name
