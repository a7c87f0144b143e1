"""Infrastructure that the engine, auth and the gateway share, below all three: Redis clients from
URLs (redis_client), local ports (ports), one-line start-up errors (config_errors) and telemetry
set-up (telemetry/: settings, the in-memory span buffer, the tracer provider).

Torch-free, and imports nothing of ours (checked by the import contracts in pyproject.toml).
"""
