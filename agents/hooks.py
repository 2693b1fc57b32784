"""What the agents app asks of linked instances, the ``peers`` app one floor up.

``agents`` sits below ``peers`` (docs/architecture.md#the-layers) and never imports it.
Where an agent's life reaches a linked instance — a shadow agent's stop, start, archive
or message goes to its peer (docs/peers.md#shadow-agents), a launch "at a location", a
peer-launched shell agent's ``DISPATCH_LAUNCH_CONTEXT``, the agent tools' peer addresses
and the launch tool's description (docs/agents.md#agent-tools), the launch form's
locations — agents call ``linked()``: the ``LinkedInstances`` that ``peers``
registers in ``PeersConfig.ready`` (``linked_register``). The one upward reference that
stays is the string foreign key ``Agent.peer`` → ``peers.Peer`` (a shadow's link).

A link is typed here by what agents read of it (``Link``), so nothing names ``peers``.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    """The peers behaviour agents use; every method is ``peers``' (``peers.remote_launch``)."""

    def location_check(self, *, user: User, location: str) -> Link:
        """The live link of ``user`` that ``location`` names (a label or an instance id);
        ``InvalidRequest`` for none or an ambiguous one (docs/peers.md#labels)."""
        ...

    async def launch(
        self,
        *,
        user: User,
        caller_agent: Agent | None,
        location: str,
        name: str,
        prompt: str,
        type: str | None,
        cwd: str | None,
        child: bool,
        full_access: bool,
    ) -> Agent:
        """Launch on the linked instance ``location`` names; the local shadow (docs/peers.md#using-a-link)."""
        ...

    async def forward(self, *, agent: Agent, action: str) -> Agent:
        """``stop``, ``start`` or ``archive`` of the shadow ``agent`` sent to its peer (docs/peers.md#shadow-agents)."""
        ...

    def message_send(
        self, *, user: User, sender_agent: Agent | None, link: Link, to_agent_id: str, content: str
    ) -> AgentMessage:
        """A message to agent ``to_agent_id`` on ``link``, through the outbox (docs/peers.md#the-outbox)."""
        ...

    def address_parse(self, *, user: User, target: str) -> tuple[Link, str] | None:
        """``(link, agent id there)`` for ``<label or instance id>:agt_<12 hex>`` naming one of
        ``user``'s live links, else ``None`` (``dispatch_send_message``, docs/agents.md#agent-tools)."""
        ...

    def labels(self, *, user: User) -> list[str]:
        """The labels of ``user``'s live links, as the tools list them in a refusal."""
        ...

    def launch_context(self, *, agent: Agent) -> str | None:
        """The preamble of an agent a peer launched here (docs/peers.md#using-a-link), or ``None``."""
        ...

    def launch_description(self, *, user: User) -> str:
        """The linked-instances sentence of ``dispatch_launch_agent`` (docs/agents.md#agent-tools)."""
        ...

    def message_delivery(self, *, message: AgentMessage) -> dict[str, Any] | None:
        """For a message sent to an agent on a peer, its outbox state (``peer``,
        ``remote_agent_id``, ``attempts``, ``next_attempt_at``, ``error``); else ``None``."""
        ...

    def launch_locations(self, *, user: User) -> Sequence[Link]:
        """``user``'s live links, by label ignoring case (the launch form's choices)."""
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
