"""One client request through the gateway: the canonical form every dialect maps to
(canonical.py), the pipeline (pipeline.py: admit -> dispatch -> respond or stream -> settle),
its steps (admission.py; dispatch.py, retries before the first event, and fallback.py; answer.py;
settlement.py), the admitted request's state (state.py), the observer telemetry hears it through
(observer.py), the errors it answers with, and the usage record it settles."""
