"""The dashboard (``celery -A app durable web``): install with ``pip install 'durable-celery[web]'``."""

from __future__ import annotations

from .server import create_app

__all__ = ["create_app"]
