"""The OpenAI-compatible HTTP server (``pip install "aiollama[server]"``)."""

from aiollama.server.app import create_app

__all__ = ["create_app"]
