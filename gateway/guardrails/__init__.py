"""Guardrails by type name: built-ins plus third-party ones from the `aigw.guardrails` entry point
group (gateway/guardrails/base.py has the contract; chain.py runs them on a request and is
imported from there: gateway/settings.py imports this package for its settings).

    [project.entry-points."aigw.guardrails"]
    myguard = "my_package.module:MyGuard"        # a subclass of gateway.guardrails.base.Guardrail
"""

from __future__ import annotations

from collections.abc import Sequence

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
from infra.plugin_registry import PluginRegistry

ENTRY_POINT_GROUP = "aigw.guardrails"
GUARDRAILS: PluginRegistry[Guardrail] = PluginRegistry(
    "guardrail type", ENTRY_POINT_GROUP, Guardrail, {
        "regex": "gateway.guardrails.regex_guard:RegexGuard",
        "pii": "gateway.guardrails.pii:PiiGuard",
        "model": "gateway.guardrails.model_guard:ModelGuard",
    })
register_guardrail = GUARDRAILS.register
get_guardrail_class = GUARDRAILS.get


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


__all__ = ["ENTRY_POINT_GROUP", "GUARDRAILS", "GUARDRAIL_BLOCKED", "Complete", "GuardContext",
           "GuardedRequest", "Guardrail", "GuardrailBlocked", "GuardrailSettings",
           "ResponseScanner", "TextPart",
           "build_guardrails", "get_guardrail_class", "register_guardrail"]
