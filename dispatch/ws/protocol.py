"""The ``/ws`` session's actions and the model each one's body is validated with
(docs/ws-protocol.md#frames, docs/ws-protocol.md#actions).

The envelope ``{"action", "nonce", "body"}`` is checked by the consumer itself, in the
order the wire pins (JSON, object, nonce, rate limit, action); then ``parse_action``
turns the action's body into its model — the remotes app's (``remotes.protocol``) for
the remote actions, the agents app's (``agents.protocol``) for ``send-agent-prompt`` —
raising ``InvalidRequest`` whose message is the error reply.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, RootModel

from agents.protocol import SendAgentPromptBody
from core.validation import parse_body
from remotes.protocol import RemoteCallBody, RemoteCallResult, RemoteConnectBody, RemoteNameBody


class NoBody(RootModel[Any]):
    """The body of an action that takes none (``ping``, ``remote-list``): whatever is sent
    is accepted and ignored."""


ActionParser = Callable[[dict[str, Any], Any], BaseModel]

# Action → (its body model, how a frame's body becomes it: (the whole frame, its body) → model).
ACTIONS: dict[str, tuple[type[BaseModel], ActionParser]] = {
    "ping": (NoBody, lambda message, body: NoBody.model_validate(body)),
    "remote-connect": (RemoteConnectBody, lambda message, body: RemoteConnectBody.parse(body)),
    "remote-disconnect": (RemoteNameBody, lambda message, body: parse_body(RemoteNameBody, body)),
    "remote-list": (NoBody, lambda message, body: NoBody.model_validate(body)),
    "remote-call": (RemoteCallBody, lambda message, body: parse_body(RemoteCallBody, body)),
    # Its fields may stand at the top level of the frame (docs/ws-protocol.md#remote-call-result).
    "remote-call-result": (RemoteCallResult, lambda message, body: RemoteCallResult.from_frame(message, body)),
    "send-agent-prompt": (SendAgentPromptBody, lambda message, body: SendAgentPromptBody.parse(body)),
}

# Never rate limited: a busy remote must be able to answer as fast as it is called (docs/ws-protocol.md#limits).
UNLIMITED_ACTIONS = frozenset({"remote-call-result", "ping"})


def parse_action(action: str, message: dict[str, Any], body: Any) -> BaseModel:
    """The body of ``action`` (a known action) as its model. Raises ``InvalidRequest``
    naming the field that is wrong."""
    return ACTIONS[action][1](message, body)
