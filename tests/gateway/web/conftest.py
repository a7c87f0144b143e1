"""The admin API's tests (test_admin_routes.py) run on each auth store: tests/auth/conftest.py's
store fixtures, function-scoped, so importing them here starts nothing twice."""

from tests.auth.conftest import auth_settings, store_kind  # noqa: F401 - fixtures, used by name
