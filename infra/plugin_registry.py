"""Classes by name: built-ins, in-process registrations, and third-party entry points of one group
(the gateway's backends and guardrails; STYLE.md rule 10: an ABC plus a registry).

    BACKENDS = PluginRegistry("backend", "aigw.backends", Backend,
                              {"replica": "gateway.backends.replica:ReplicaBackend"})
    BACKENDS.register("custom", Custom)     # in-process (tests, embedding applications)
    BACKENDS.get("replica")                 # imported on first use, then kept

Lookup order: registered, built in, then the entry point group (`[project.entry-points."<group>"]`
`name = "package.module:Class"`). An unknown name is a ValueError naming the group; a target that
is not a subclass of `base`, a TypeError.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Generic, TypeVar, cast

T = TypeVar("T")


class PluginRegistry(Generic[T]):
    def __init__(self, kind: str, group: str, base: type[object], builtin: Mapping[str, str]
                 ) -> None:
        """`base`: the class every entry must subclass (T, given as the annotation: mypy takes
        no abstract class for a type[T] argument)."""
        self.kind = kind  # what an error calls a name: "backend", "guardrail type"
        self.group = group
        self.base = base
        self._builtin = dict(builtin)
        self._registered: dict[str, type[T]] = {}

    def register(self, name: str, cls: type[T]) -> None:
        """Register a class in-process (an entry point does the same from a package)."""
        self._registered[name] = cls

    def get(self, name: str) -> type[T]:
        found = self._registered.get(name)
        if found is not None:
            return found
        target = self._builtin.get(name)
        if target is None:
            target = next((entry.value for entry in entry_points(group=self.group)
                           if entry.name == name), None)
        if target is None:
            raise ValueError(f"unknown {self.kind} {name!r}: not built in and no {self.group} "
                             "entry point of that name")
        module_name, _, attr = target.partition(":")
        loaded = getattr(importlib.import_module(module_name), attr)
        if not (isinstance(loaded, type) and issubclass(loaded, self.base)):
            raise TypeError(f"{target} is not a {self.base.__name__} subclass")
        cls = cast("type[T]", loaded)
        self._registered[name] = cls
        return cls
