"""The ops dashboard: a static page (gateway/dashboard/static/) at GET /dashboard, and the JSON it
polls under /dashboard/api/ (admin credential required). See gateway/dashboard/handlers.py."""

from pathlib import Path

STATIC_DIR = Path(__file__).parent / "static"
