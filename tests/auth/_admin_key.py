"""The operator's credential tests start a gateway with: an admin key of project "ops"."""

from __future__ import annotations

from auth import AuthSettings, Scope, open_auth


async def make_admin_key(settings: AuthSettings) -> str:
    """Create project "ops" and an admin key of it named "operator" in the auth store `settings`
    name (the store is closed again) -> the key."""
    services = await open_auth(settings)
    try:
        await services.admin.create_project("ops")
        _, key = await services.admin.create_key("ops", [Scope.ADMIN.value], name="operator")
        return key
    finally:
        await services.close()
