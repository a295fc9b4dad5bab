"""The HTTP gateway: translates requests into broker calls and broker state back into responses."""

from sluice.api.app import create_app

__all__ = ["create_app"]
