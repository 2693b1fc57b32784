"""Client library for Dispatch remotes: serve Python functions over ``/ws`` (spec §2.5).

Imports nothing from Django; depends on ``websockets``, ``pydantic`` and
``docstring_parser`` only.
"""

from __future__ import annotations

from .remote import Remote, RemoteDisconnected
from .schema import function_spec
from .session import (
    AuthenticationError,
    MessageTooLarge,
    RemoteCallError,
    Session,
)

__all__ = [
    "AuthenticationError",
    "MessageTooLarge",
    "Remote",
    "RemoteCallError",
    "RemoteDisconnected",
    "Session",
    "function_spec",
]
