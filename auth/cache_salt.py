"""The prompt-cache salt of a request, so that prompt caching never crosses tenants.

Requests with different salts never share cached prefix blocks. By default the salt is the
project (keys of one project share a cache); `cache_salt_scope="key"` narrows it to the key, and
`"shared"` opts into one cache across projects (no salt).
"""

from __future__ import annotations

from auth.principal import Principal
from auth.settings import AuthSettings


def cache_salt_for(principal: Principal, settings: AuthSettings) -> str | None:
    if settings.cache_salt_scope == "shared":
        return None
    if settings.cache_salt_scope == "key":
        return f"key:{principal.project}:{principal.key_id}"
    return f"project:{principal.project}"
