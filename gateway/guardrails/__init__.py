"""Guardrails by type name: built-ins plus third-party ones from the `aigw.guardrails` entry point
group (gateway/guardrails/base.py has the contract; chain.py runs them on a request and is
imported from there: gateway/settings.py imports this package for its settings).

    [project.entry-points."aigw.guardrails"]
    myguard = "my_package.module:MyGuard"        # a subclass of gateway.guardrails.base.Guardrail
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from importlib.metadata import entry_points

from gateway.guardrails.base import (
    GUARDRAIL_BLOCKED,
    Complete,
    GuardContext,
    GuardedRequest,
    Guardrail,
    GuardrailBlocked,
    ResponseScanner,
    TextPart,
)
from gateway.guardrails.settings import GuardrailSettings

ENTRY_POINT_GROUP = "aigw.guardrails"
_BUILTIN = {
    "regex": "gateway.guardrails.regex_guard:RegexGuard",
    "pii": "gateway.guardrails.pii:PiiGuard",
    "model": "gateway.guardrails.model_guard:ModelGuard",
}
_registered: dict[str, type[Guardrail]] = {}


def register_guardrail(name: str, guard_class: type[Guardrail]) -> None:
    """Register a guardrail class in-process (entry points do the same from a package)."""
    _registered[name] = guard_class


def get_guardrail_class(name: str) -> type[Guardrail]:
    if name in _registered:
        return _registered[name]
    target = _BUILTIN.get(name)
    if target is None:
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            if entry.name == name:
                target = entry.value
                break
    if target is None:
        raise ValueError(f"unknown guardrail type {name!r}: not built in and no "
                         f"{ENTRY_POINT_GROUP} entry point of that name")
    module_name, _, attr = target.partition(":")
    guard_class = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(guard_class, type) and issubclass(guard_class, Guardrail)):
        raise TypeError(f"{target} is not a Guardrail subclass")
    _registered[name] = guard_class
    return guard_class


def build_guardrails(configured: Sequence[GuardrailSettings], complete: Complete
                     ) -> list[tuple[GuardrailSettings, Guardrail]]:
    """Each configured guard built (ValueError for a bad one, naming it), in config order."""
    context = GuardContext(complete)
    names = [settings.name for settings in configured]
    if len(set(names)) != len(names):
        raise ValueError("guardrail names must be unique")
    return [(settings, get_guardrail_class(settings.type)(settings.name, settings.options,
                                                          context))
            for settings in configured]


__all__ = ["ENTRY_POINT_GROUP", "GUARDRAIL_BLOCKED", "Complete", "GuardContext", "GuardedRequest",
           "Guardrail", "GuardrailBlocked", "GuardrailSettings", "ResponseScanner", "TextPart",
           "build_guardrails", "get_guardrail_class", "register_guardrail"]
