"""Backends by name: built-ins plus third-party ones from the `aigw.backends` entry point group.

    [project.entry-points."aigw.backends"]
    mybackend = "my_package.module:MyBackend"     # a subclass of gateway.backends.base.Backend
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from gateway.backends.base import Backend

ENTRY_POINT_GROUP = "aigw.backends"
_BUILTIN = {
    "replica": "gateway.backends.replica:ReplicaBackend",
    "openai": "gateway.backends.openai_compat:OpenAICompatBackend",
    "anthropic": "gateway.backends.anthropic:AnthropicBackend",
}
_registered: dict[str, type[Backend]] = {}


def register_backend(name: str, backend_class: type[Backend]) -> None:
    """Register a backend class in-process (entry points do the same from a package)."""
    _registered[name] = backend_class


def get_backend_class(name: str) -> type[Backend]:
    if name in _registered:
        return _registered[name]
    target = _BUILTIN.get(name)
    if target is None:
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            if entry.name == name:
                target = entry.value
                break
    if target is None:
        raise ValueError(f"unknown backend {name!r}: not built in and no {ENTRY_POINT_GROUP} "
                         "entry point of that name")
    module_name, _, attr = target.partition(":")
    backend_class = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(backend_class, type) and issubclass(backend_class, Backend)):
        raise TypeError(f"{target} is not a Backend subclass")
    _registered[name] = backend_class
    return backend_class


__all__ = ["Backend", "ENTRY_POINT_GROUP", "get_backend_class", "register_backend"]
