"""What the agents app's domain code asks of linked instances, the ``peers`` app one floor up.

``agents``' domain code (models, services, lifecycle, the CLI launch; docs/architecture.md#the-layers)
sits below ``peers`` and never imports it. Where an agent's life reaches a linked instance —
a shadow agent's stop, start or archive and a message to it go to its peer
(docs/peers.md#shadow-agents), a peer-launched shell agent's ``DISPATCH_LAUNCH_CONTEXT`` —
it calls ``linked()``: the ``LinkedInstances`` that ``peers`` registers in
``PeersConfig.ready`` (``linked_register``). The agents app's edges (REST, pages, the agent
tools) sit above ``peers`` and import it directly: a launch "at a location", peer addresses,
the launch tool's description and the launch form's locations are theirs. The one upward
reference that stays is the string foreign key ``Agent.peer`` → ``peers.Peer`` (a shadow's link).

A link is typed here by what agents read of it (``Link``), so nothing names ``peers``.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from django.core.exceptions import ImproperlyConfigured

if TYPE_CHECKING:
    from django.contrib.auth.models import User

    from agents.models import Agent, AgentMessage


class Link(Protocol):
    """A linked instance as agents see it (a ``peers.Peer`` row)."""

    @property
    def pk(self) -> Any: ...

    @property
    def owner_id(self) -> int: ...

    @property
    def label(self) -> str: ...

    @property
    def instance_id(self) -> str: ...

    def responding(self, now: datetime | None = None) -> bool:
        """Whether the peer was seen recently (``last_seen_at``)."""
        ...

    def launch_refusal(self) -> str:
        """Why a launch there cannot be chosen (``""`` when it can)."""
        ...


class LinkedInstances(Protocol):
    """What agents' domain code, which may not import ``peers``, needs of linked instances;
    ``peers``' ``peers.remote_launch.PeerLinks``. The agents app's edges import ``peers``."""

    async def forward(self, *, agent: Agent, action: str) -> Agent:
        """``stop``, ``start`` or ``archive`` of the shadow ``agent`` sent to its peer (docs/peers.md#shadow-agents)."""
        ...

    def message_send(
        self, *, user: User, sender_agent: Agent | None, link: Link, to_agent_id: str, content: str
    ) -> AgentMessage:
        """A message to agent ``to_agent_id`` on ``link``, through the outbox (docs/peers.md#the-outbox)."""
        ...

    def launch_context(self, *, agent: Agent) -> str | None:
        """The preamble of an agent a peer launched here (docs/peers.md#using-a-link), or ``None``."""
        ...


_linked: LinkedInstances | None = None


def linked_register(implementation: LinkedInstances) -> None:
    """Install the linked-instances behaviour (``PeersConfig.ready``); the last one wins."""
    global _linked
    _linked = implementation


def linked() -> LinkedInstances:
    """The registered ``LinkedInstances``. Raises ``ImproperlyConfigured`` when ``peers`` is
    not installed (no ``PeersConfig.ready`` registered it)."""
    if _linked is None:
        raise ImproperlyConfigured("linked instances are unavailable: the peers app is not installed")
    return _linked
