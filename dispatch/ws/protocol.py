"""The ``/ws`` session's actions: what an entry of the action table holds, and how each
action's body becomes its model (docs/ws-protocol.md#frames, docs/ws-protocol.md#actions).

The envelope ``{"action", "nonce", "body"}`` is checked by the consumer itself, in the
order the wire pins (JSON, object, nonce, rate limit, action); then the action's entry in
``SessionConsumer.ACTIONS`` (an ``Action``) turns the body into its model — the remotes
app's (``remotes.protocol``) for the remote actions, the agents app's (``agents.protocol``)
for ``send-agent-prompt`` — raising ``InvalidRequest`` whose message is the error reply, and
names the handler that gets the model. The table is the consumer's class attribute, next to
the handlers it names, so an action is keyed in one place. Below: the checks on a frame's
text before it is parsed (its size in UTF-8) and on what a refused frame still lets the
consumer echo (its ``nonce``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from django.conf import settings
from pydantic import BaseModel, RootModel

from agents.protocol import SendAgentPromptBody
from core import wire
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


def readable_nonce(refused: dict[str, Any] | None) -> str | int | float | None:
    """The ``nonce`` of a frame the strict parse refused (``wire.lenient_object``), when it
    can be echoed (a string, or a number the channel layer and strict parsers accept)."""
    nonce = wire.lenient_field(refused, "nonce", nested=False)
    if isinstance(nonce, bool) or not isinstance(nonce, str | int | float):
        return None
    return nonce if wire.problem(nonce) is None else None


def utf8_over(text: str, limit: int) -> bool:
    """Whether ``text`` is over ``limit`` bytes in UTF-8, encoding it only when its length
    cannot tell: a character is 1 to 4 bytes, so ``len(text)`` over the limit is over, and
    ``4 * len(text)`` within it is within."""
    characters = len(text)
    if characters > limit:
        return True
    if 4 * characters <= limit:
        return False
    return len(text.encode()) > limit


def utf8_length(text: str) -> int:
    """Length of ``text`` in UTF-8 bytes (its length in characters once that is over the limit)."""
    return len(text) if len(text) > settings.WS_MAX_MESSAGE_BYTES else len(text.encode())


def json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")
