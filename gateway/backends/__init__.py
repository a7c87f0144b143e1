"""Backends by name: built-ins plus third-party ones from the `aigw.backends` entry point group.

    [project.entry-points."aigw.backends"]
    mybackend = "my_package.module:MyBackend"     # a subclass of gateway.backends.base.Backend
"""

from __future__ import annotations

from gateway.backends.base import Backend
from infra.plugin_registry import PluginRegistry

ENTRY_POINT_GROUP = "aigw.backends"
BACKENDS: PluginRegistry[Backend] = PluginRegistry("backend", ENTRY_POINT_GROUP, Backend, {
    "replica": "gateway.backends.replica:ReplicaBackend",
    "openai": "gateway.backends.openai_compat:OpenAICompatBackend",
    "anthropic": "gateway.backends.anthropic:AnthropicBackend",
})
register_backend = BACKENDS.register
get_backend_class = BACKENDS.get

__all__ = ["BACKENDS", "Backend", "ENTRY_POINT_GROUP", "get_backend_class", "register_backend"]
