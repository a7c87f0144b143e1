"""One client request through the gateway: the canonical form every dialect maps to
(canonical.py), the pipeline (admit -> dispatch -> respond or stream -> settle, pipeline.py),
dispatching to an endpoint with retries (dispatch.py), the errors it answers with, and the usage
record it settles."""
