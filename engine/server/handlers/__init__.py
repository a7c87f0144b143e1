"""Thin aiohttp handlers: parse, delegate, answer. The URL table is engine/server/routes.py."""
