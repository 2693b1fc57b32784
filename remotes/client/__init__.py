"""Client library for Dispatch remotes: serve Python functions over ``/ws``
(docs/ws-protocol.md#the-python-client).

Imports nothing from Django; depends on ``websockets``, ``pydantic`` and
``docstring_parser`` only. Installed as the package ``dispatch_remote`` (``from
dispatch_remote import Remote``) with the command ``dispatch-remote`` (this folder's
pyproject.toml; ``make dist``), hence the relative imports inside; in a clone of the
server: ``remotes.client`` and ``python -m remotes.client``.
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
