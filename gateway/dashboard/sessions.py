"""GET /dashboard/api/sessions/{project}/{session}: one session's last turns, each with its prompt
and cached tokens, hit ratio and where its prompt diverged from the turn before
(gateway/request/cache_explainer.py). An admin credential, like every dashboard call; a session
is looked up within the project named in the path, never across projects.

    {"project": "default", "session": "s1", "turns": [{"turn": 1, "request_id": ..., "at": ...,
      "prompt_tokens": 40, "cached_tokens": 0, "hit_ratio": 0.0, "divergence": null}, ...]}
"""

from __future__ import annotations

from aiohttp import web

from gateway.dashboard.handlers import _json, _require_admin
from gateway.request.cache_explainer import describe
from gateway.web.keys import PIPELINE


async def session(request: web.Request) -> web.Response:
    denied = await _require_admin(request)
    if denied is not None:
        return denied
    project, name = request.match_info["project"], request.match_info["session"]
    turns = request.app[PIPELINE].cache_explainer.turns(project, name)
    return _json({"project": project, "session": name, "turns": [describe(t) for t in turns]})
