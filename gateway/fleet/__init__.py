"""The upstream endpoints of each model and their state: the fleet (endpoints.py), DNS discovery,
active health checks, per-endpoint circuit breakers, and the embedded replicas `aigw serve` starts
and supervises."""
