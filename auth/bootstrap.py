"""First embedded start: a `default` project and one ready key, shown once."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from auth.principal import Scope
from auth.store import ProjectExists

if TYPE_CHECKING:
    from auth import AuthServices

DEFAULT_PROJECT = "default"


async def ensure_default_project(services: AuthServices) -> str | None:
    """Create project `default` and an invoke+usage:read key when no project exists yet.

    Returns the new key (the caller prints it once, with `settings.default_key_path`, where it is
    also written with 0600 permissions), or None when projects already existed or auth is off.
    """
    if not services.settings.enabled or await services.store.list_projects():
        return None
    try:
        await services.admin.create_project(DEFAULT_PROJECT)
    except ProjectExists:  # another instance won the race
        return None
    _, secret = await services.admin.create_key(
        DEFAULT_PROJECT, [Scope.INVOKE.value, Scope.USAGE_READ.value], name="default")
    path = services.settings.default_key_path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secret + "\n")
    os.chmod(path, 0o600)
    return secret
