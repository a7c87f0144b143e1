"""The gateway's HTTP edge: the app factory (app.py) and its typed state (keys.py), the URL table
(routes.py) and thin handlers (handlers.py, token_count.py, admin_routes.py), middlewares, the
credential rule, the real auth and metering wiring (services.py) and the serving process
(server.py)."""
