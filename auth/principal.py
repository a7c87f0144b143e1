"""Who is calling: the result of checking a credential, and the errors a check can end in.

This module is the seam between the gateway and `auth/`: the gateway hands the raw credential
(from `Authorization: Bearer` or `x-api-key`) to an `Authenticator` and gets a `Principal` back,
or an `AuthError` that carries the HTTP status to answer with (401 unknown/invalid/revoked/expired
credential, 403 valid credential without the needed scope or model).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal, Protocol

_PROJECT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # fullmatch: "$" let "a\n" in


def is_project_name(name: str) -> bool:
    """1-64 letters, digits and '_.-', starting with a letter or digit: what every project is
    named (an API key's, or a JWT's `project` claim). Store keys, metric labels and file names
    are built from it, so no name holds a separator (':', '{', '}', '/', whitespace)."""
    return _PROJECT_NAME.fullmatch(name) is not None


class Scope(StrEnum):
    INVOKE = "ai_gateway:invoke"
    USAGE_READ = "ai_gateway:usage:read"
    ADMIN = "ai_gateway:admin"


class AuthError(Exception):
    """A credential was refused. `status` is 401 (who are you?) or 403 (not allowed)."""

    def __init__(self, status: Literal[401, 403], code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Principal:
    project: str
    key_id: str  # public key id, or "jwt:<sub>" for JWT callers
    scopes: frozenset[str]
    allowed_models: frozenset[str] | None = None  # None = every model
    via: Literal["api_key", "jwt", "anonymous"] = "api_key"

    def require(self, scope: Scope) -> None:
        # (`_value_`, the member's value as a plain attribute: `.value` is two Python calls, and
        # this runs on every request)
        if scope._value_ not in self.scopes and Scope.ADMIN._value_ not in self.scopes:
            raise AuthError(403, "insufficient_scope",
                            f"this credential lacks the scope {scope.value}")

    def require_model(self, model: str) -> None:
        if self.allowed_models is not None and model not in self.allowed_models:
            raise AuthError(403, "model_not_allowed",
                            f"this credential may not call model {model!r}")

    def require_project(self, project: str) -> None:
        if project != self.project and Scope.ADMIN.value not in self.scopes:
            raise AuthError(403, "wrong_project", "this credential belongs to another project")


class Authenticator(Protocol):
    async def authenticate(self, credential: str | None) -> Principal:
        """Return the caller, or raise AuthError(401) for a missing/invalid/revoked/expired one."""
        ...


# Auth turned off (`aigw serve --no-auth`, AuthSettings.enabled false): every caller is this one
# principal, which may call models and read its own usage, and administer nothing.
ANONYMOUS = Principal(project="anonymous", key_id="anonymous",
                      scopes=frozenset({Scope.INVOKE.value, Scope.USAGE_READ.value}),
                      via="anonymous")
