"""The ``/ws`` session's actions: what an entry of the action table holds, and how each
action's body becomes its model (docs/ws-protocol.md#frames, docs/ws-protocol.md#actions).

The envelope ``{"action", "nonce", "body"}`` is checked by the consumer itself, in the
order the wire pins (JSON, object, nonce, rate limit, action); then the action's entry in
``SessionConsumer.ACTIONS`` (an ``Action``) turns the body into its model — the remotes
app's (``remotes.protocol``) for the remote actions, the agents app's (``agents.protocol``)
for ``send-agent-prompt`` — raising ``InvalidRequest`` whose message is the error reply, and
names the handler that gets the model. The table is the consumer's class attribute, next to
the handlers it names, so an action is keyed in one place.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, RootModel

from agents.protocol import SendAgentPromptBody
from core.validation import parse_body
from dispatch.ws.frames import Nonce
from remotes.protocol import RemoteCallBody, RemoteCallResult, RemoteConnectBody, RemoteNameBody


class NoBody(RootModel[Any]):
    """The body of an action that takes none (``ping``, ``remote-list``): whatever is sent
    is accepted and ignored."""


BodyT = TypeVar("BodyT", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class Action(Generic[BodyT]):
    """One row of the action table.

    ``body``: the model the action's body becomes. ``parse(frame, body)``: how (the whole
    frame, as a dict, and its ``body``, ``{}`` when absent or null) → a ``body`` instance;
    raises ``InvalidRequest`` naming the wrong field. ``handler(session, parsed, nonce)``: the
    consumer's method that acts and replies. ``limited``: whether the action counts against
    the session's rate limit (docs/ws-protocol.md#limits)."""

    body: type[BodyT]
    parse: Callable[[dict[str, Any], Any], BodyT]
    handler: Callable[[Any, BodyT, Nonce | None], Awaitable[None]]
    limited: bool = True


def any_body(message: dict[str, Any], body: Any) -> NoBody:
    """``ping``'s and ``remote-list``'s body: anything, ignored."""
    return NoBody.model_validate(body)


def remote_connect_body(message: dict[str, Any], body: Any) -> RemoteConnectBody:
    return RemoteConnectBody.parse(body)


def remote_name_body(message: dict[str, Any], body: Any) -> RemoteNameBody:
    return parse_body(RemoteNameBody, body)


def remote_call_body(message: dict[str, Any], body: Any) -> RemoteCallBody:
    return parse_body(RemoteCallBody, body)


def remote_call_result_body(message: dict[str, Any], body: Any) -> RemoteCallResult:
    """Its fields may stand at the top level of the frame (docs/ws-protocol.md#remote-call-result)."""
    return RemoteCallResult.from_frame(message, body)


def send_agent_prompt_body(message: dict[str, Any], body: Any) -> SendAgentPromptBody:
    return SendAgentPromptBody.parse(body)
