"""The WSGI entry point for gunicorn: the only place an app is built at import time."""

from gateway.app import create_app

app = create_app()
