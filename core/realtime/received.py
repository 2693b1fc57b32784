"""What arrives off the channel layer, validated with its model (``message_received``):
one that does not fit is logged and dropped, never raised into a loop or a consumer
(docs/architecture.md#how-the-code-is-written). Shared by ``Subscription``,
``request_reply`` and ``core.consumers``.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from pydantic import ValidationError

from core.protocol import ChannelMessage
from core.validation import describe_validation_error

logger = logging.getLogger("core.realtime")  # the package's one logger, as before its split into modules

Message = TypeVar("Message", bound=ChannelMessage)


def _kind(message: Any) -> str:
    """The ``type`` of a message off the layer, for a log line (``None`` when it has none)."""
    return repr(message.get("type") if isinstance(message, dict) else None)[:100]


def message_received(model: type[Message], message: Any, *, receiver: str) -> Message | None:
    """``message`` (a dict taken from the layer) validated as ``model``
    (``ChannelMessage.received``), or ``None`` when it does not fit: then one warning names
    the ``receiver``, the message's type and what is wrong, and the message is dropped — a
    malformed message never raises into a consumer or a loop."""
    try:
        return model.received(message)
    except ValidationError as exc:
        logger.warning(
            "%s dropped a malformed message of type %s: %s", receiver, _kind(message), describe_validation_error(exc)
        )
        return None
