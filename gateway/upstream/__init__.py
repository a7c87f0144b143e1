"""Upstream I/O: the one-method transport (transport.py) and its HTTP/1.1 implementation
(lean_transport.py), wait timeouts without a timer per wait, and the retry budget."""
